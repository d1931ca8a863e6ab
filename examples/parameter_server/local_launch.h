#pragma once

// The single-command mode: starts every worker of the job as a child
// process of this one, with the variables a launcher (torchrun) would set.

#include <functional>

namespace ps {

// Forks `worldSize` children, each with RANK, WORLD_SIZE, MASTER_ADDR
// (loopback) and MASTER_PORT (a free port) set, running `worker()` and
// exiting with its result. When one fails, stops the others (SIGTERM); a
// child dies with this process; SIGINT/SIGTERM here reach the children.
// Returns 0 when every child exited with 0.
int launchLocally(int worldSize, const std::function<int()>& worker);

} // namespace ps
