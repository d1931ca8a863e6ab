#pragma once

// A trainer (rank >= 1): trains the server's model on its own shard of the
// training set, concurrently with the other trainers (asynchronous SGD):
// forward through the RemoteModule, distributed backward, and a step of its
// own DistributedOptimizer, which runs on the server where the parameters
// live.

#include "config.h"

namespace torchrpc {
class Runtime;
} // namespace torchrpc

namespace ps {

// Trains as trainer `trainer` (1-based, = rank) after rt.start(); returns the
// exit code. Tells the server when it fails.
int runTrainer(torchrpc::Runtime& runtime, const Config& config, int trainer);

} // namespace ps
