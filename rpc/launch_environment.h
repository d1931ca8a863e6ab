#pragma once

#include <c10/util/Optional.h>

#include <cstdint>
#include <string>

namespace torchrpc {
namespace rpc {

// The program that started this process, as told by its environment.
enum class Launcher {
  // No launcher's variables: a single worker, or one started by hand.
  kNone,
  // torchrun (or torchrpc-launch, which sets the same variables): RANK, ...
  kTorchrun,
  // Open MPI's mpirun: OMPI_COMM_WORLD_*.
  kOpenMpi,
  // Slurm's srun: SLURM_*.
  kSlurm,
};

// "none", "torchrun", "Open MPI", "Slurm": how errors name the launcher.
const char* launcherName(Launcher launcher);

// Who this worker is within its job, read from the variables of whichever
// launcher started it. See Note [Launch environment].
//
// Note [Launch environment]
// Launchers are tried in this order; the first whose rank variable is set
// wins (mpirun inside a Slurm allocation sets both; its own are the truth):
//  1. torchrun: RANK, WORLD_SIZE (both required once RANK is set),
//     LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK (required when
//     TORCHELASTIC_RUN_ID says the elastic agent started us; otherwise they
//     default to a single node: LOCAL_RANK = RANK, LOCAL_WORLD_SIZE =
//     WORLD_SIZE, GROUP_RANK = 0), TORCHELASTIC_RESTART_COUNT,
//     TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID, MASTER_ADDR and
//     MASTER_PORT (checked when the env:// rendezvous needs them).
//  2. Open MPI: OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE,
//     OMPI_COMM_WORLD_LOCAL_RANK (required), OMPI_COMM_WORLD_LOCAL_SIZE
//     (default: the world size). The master is MASTER_ADDR / MASTER_PORT;
//     when the whole job is on one node (local size = world size) they
//     default to 127.0.0.1 and kDefaultMasterPort. Across nodes MASTER_ADDR
//     is required (the env:// rendezvous says so).
//  3. Slurm: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID (required),
//     SLURM_NODEID (default 0), SLURM_STEP_TASKS_PER_NODE or
//     SLURM_TASKS_PER_NODE for the local size. The master address is
//     MASTER_ADDR or else the first host of SLURM_STEP_NODELIST (else
//     SLURM_JOB_NODELIST); the port MASTER_PORT or else 10000 + SLURM_JOB_ID
//     mod 10000, so that jobs sharing a node differ.
// A malformed value (not an integer, a rank outside the world) throws
// c10::Error naming the variable and the launcher.
//
// TORCHELASTIC_RESTART_COUNT numbers the generations of a restarted group;
// the rendezvous keeps each generation's keys apart, so a group restarted
// against the agent's long-lived store never reads the keys its failed
// predecessor left there (see Rendezvous in rpc/detail/rendezvous.h).
struct LaunchEnvironment {
  // The master port Open MPI jobs on one node use when MASTER_PORT is unset
  // (torchrun's default).
  static constexpr int kDefaultMasterPort = 29500;

  Launcher launcher = Launcher::kNone;
  int64_t rank = 0;
  int64_t worldSize = 1;
  // This worker's index among the workers of its node, and their number.
  int64_t localRank = 0;
  int64_t localWorldSize = 1;
  // The node's index (torchrun's GROUP_RANK, Slurm's SLURM_NODEID); unset
  // when the launcher does not say (Open MPI).
  c10::optional<int64_t> groupRank;
  // Where the env:// rendezvous meets: empty / 0 when the launcher leaves
  // it to MASTER_ADDR / MASTER_PORT and those are unset.
  std::string masterAddr;
  int masterPort = 0;
  // How many times the group was restarted (torchrun's
  // TORCHELASTIC_RESTART_COUNT), and how many times it may be.
  int64_t restartCount = 0;
  int64_t maxRestarts = 0;
  // torchrun's TORCHELASTIC_RUN_ID; empty otherwise.
  std::string runId;

  // Reads the process environment as Note [Launch environment] says.
  static LaunchEnvironment fromEnvironment();
};

} // namespace rpc
} // namespace torchrpc
