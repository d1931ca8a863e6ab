#include "torchrpc/rpc/launch_environment.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

#include "torchrpc/rpc/detail/slurm_hostlist.h"

namespace torchrpc {
namespace rpc {

namespace {

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

// Reads the variables of one launcher; every error names the variable and
// the launcher.
class Reader {
 public:
  explicit Reader(Launcher launcher) : launcher_(launcher) {}

  int64_t require(const char* name) const {
    const char* value = env(name);
    TORCH_CHECK(
        value != nullptr,
        "environment variable ",
        name,
        " is not set, but the other variables say ",
        launcherName(launcher_),
        " started this process");
    return parse(name, value);
  }

  int64_t optional(const char* name, int64_t fallback) const {
    const char* value = env(name);
    return value == nullptr ? fallback : parse(name, value);
  }

  void check(bool ok, const char* name, const std::string& what) const {
    TORCH_CHECK(
        ok,
        "environment variable ",
        name,
        " (set by ",
        launcherName(launcher_),
        ") ",
        what,
        ", got '",
        env(name) == nullptr ? "" : env(name),
        "'");
  }

 private:
  int64_t parse(const char* name, const char* value) const {
    char* end = nullptr;
    long long parsed = std::strtoll(value, &end, 10);
    check(
        end != value && *end == '\0' && parsed >= 0,
        name,
        "must be a non-negative integer");
    return parsed;
  }

  Launcher launcher_;
};

// MASTER_ADDR / MASTER_PORT override whatever a launcher's default is.
void readMaster(const Reader& reader, LaunchEnvironment& launch) {
  if (const char* address = env("MASTER_ADDR")) {
    launch.masterAddr = address;
  }
  if (env("MASTER_PORT") != nullptr) {
    int64_t port = reader.optional("MASTER_PORT", 0);
    reader.check(port <= 65535, "MASTER_PORT", "must be a port (0-65535)");
    launch.masterPort = static_cast<int>(port);
  }
}

void checkRanks(
    const Reader& reader,
    const LaunchEnvironment& launch,
    const char* rankName,
    const char* sizeName,
    const char* localRankName,
    const char* localSizeName) {
  reader.check(launch.worldSize >= 1, sizeName, "must be at least 1");
  reader.check(
      launch.rank < launch.worldSize,
      rankName,
      "must be below " + std::string(sizeName) + " (" +
          std::to_string(launch.worldSize) + ")");
  reader.check(
      launch.localWorldSize >= 1 && launch.localWorldSize <= launch.worldSize,
      localSizeName,
      "must be between 1 and " + std::string(sizeName) + " (" +
          std::to_string(launch.worldSize) + ")");
  reader.check(
      launch.localRank < launch.localWorldSize,
      localRankName,
      "must be below " + std::string(localSizeName) + " (" +
          std::to_string(launch.localWorldSize) + ")");
}

LaunchEnvironment fromTorchrun() {
  Reader reader(Launcher::kTorchrun);
  LaunchEnvironment launch;
  launch.launcher = Launcher::kTorchrun;
  launch.rank = reader.require("RANK");
  launch.worldSize = reader.require("WORLD_SIZE");
  // The elastic agent always sets the local variables; a hand-made
  // environment (RANK and WORLD_SIZE only) is taken as a single node.
  bool fromAgent = env("TORCHELASTIC_RUN_ID") != nullptr;
  if (fromAgent) {
    launch.localRank = reader.require("LOCAL_RANK");
    launch.localWorldSize = reader.require("LOCAL_WORLD_SIZE");
    launch.groupRank = reader.require("GROUP_RANK");
    launch.runId = env("TORCHELASTIC_RUN_ID");
  } else {
    launch.localRank = reader.optional("LOCAL_RANK", launch.rank);
    launch.localWorldSize =
        reader.optional("LOCAL_WORLD_SIZE", launch.worldSize);
    launch.groupRank = reader.optional("GROUP_RANK", 0);
  }
  launch.restartCount = reader.optional("TORCHELASTIC_RESTART_COUNT", 0);
  launch.maxRestarts = reader.optional("TORCHELASTIC_MAX_RESTARTS", 0);
  checkRanks(
      reader,
      launch,
      "RANK",
      "WORLD_SIZE",
      "LOCAL_RANK",
      "LOCAL_WORLD_SIZE");
  readMaster(reader, launch);
  return launch;
}

LaunchEnvironment fromOpenMpi() {
  Reader reader(Launcher::kOpenMpi);
  LaunchEnvironment launch;
  launch.launcher = Launcher::kOpenMpi;
  launch.rank = reader.require("OMPI_COMM_WORLD_RANK");
  launch.worldSize = reader.require("OMPI_COMM_WORLD_SIZE");
  launch.localRank = reader.require("OMPI_COMM_WORLD_LOCAL_RANK");
  launch.localWorldSize =
      reader.optional("OMPI_COMM_WORLD_LOCAL_SIZE", launch.worldSize);
  checkRanks(
      reader,
      launch,
      "OMPI_COMM_WORLD_RANK",
      "OMPI_COMM_WORLD_SIZE",
      "OMPI_COMM_WORLD_LOCAL_RANK",
      "OMPI_COMM_WORLD_LOCAL_SIZE");
  // mpirun says nothing about a master; on one node every worker can agree
  // on loopback and a fixed port.
  if (launch.localWorldSize == launch.worldSize) {
    launch.masterAddr = "127.0.0.1";
    launch.masterPort = LaunchEnvironment::kDefaultMasterPort;
  }
  readMaster(reader, launch);
  return launch;
}

LaunchEnvironment fromSlurm() {
  Reader reader(Launcher::kSlurm);
  LaunchEnvironment launch;
  launch.launcher = Launcher::kSlurm;
  launch.rank = reader.require("SLURM_PROCID");
  launch.worldSize = reader.require("SLURM_NTASKS");
  launch.localRank = reader.require("SLURM_LOCALID");
  int64_t node = reader.optional("SLURM_NODEID", 0);
  launch.groupRank = node;
  const char* perNodeName = env("SLURM_STEP_TASKS_PER_NODE") != nullptr
      ? "SLURM_STEP_TASKS_PER_NODE"
      : "SLURM_TASKS_PER_NODE";
  launch.localWorldSize = launch.worldSize;
  if (const char* perNode = env(perNodeName)) {
    std::vector<int64_t> counts;
    try {
      counts = detail::expandSlurmTasksPerNode(perNode);
    } catch (const c10::Error& e) {
      reader.check(false, perNodeName, e.what_without_backtrace());
    }
    reader.check(
        node < static_cast<int64_t>(counts.size()),
        perNodeName,
        "must have an entry for SLURM_NODEID " + std::to_string(node));
    launch.localWorldSize = counts[node];
  }
  checkRanks(
      reader,
      launch,
      "SLURM_PROCID",
      "SLURM_NTASKS",
      "SLURM_LOCALID",
      perNodeName);
  const char* listName = env("SLURM_STEP_NODELIST") != nullptr
      ? "SLURM_STEP_NODELIST"
      : "SLURM_JOB_NODELIST";
  if (const char* nodes = env(listName)) {
    std::vector<std::string> hosts;
    try {
      hosts = detail::expandSlurmHostlist(nodes);
    } catch (const c10::Error& e) {
      reader.check(false, listName, e.what_without_backtrace());
    }
    launch.masterAddr = hosts.front();
  }
  if (env("SLURM_JOB_ID") != nullptr) {
    launch.masterPort =
        10000 + static_cast<int>(reader.require("SLURM_JOB_ID") % 10000);
  }
  readMaster(reader, launch);
  if (launch.masterAddr.empty()) {
    reader.require("SLURM_JOB_NODELIST"); // throws, naming it
  }
  if (launch.masterPort == 0) {
    reader.require("SLURM_JOB_ID"); // throws, naming it
  }
  return launch;
}

} // namespace

const char* launcherName(Launcher launcher) {
  switch (launcher) {
    case Launcher::kNone:
      return "none";
    case Launcher::kTorchrun:
      return "torchrun";
    case Launcher::kOpenMpi:
      return "Open MPI";
    case Launcher::kSlurm:
      return "Slurm";
  }
  return "unknown";
}

LaunchEnvironment LaunchEnvironment::fromEnvironment() {
  if (env("RANK") != nullptr || env("WORLD_SIZE") != nullptr) {
    return fromTorchrun();
  }
  if (env("OMPI_COMM_WORLD_RANK") != nullptr ||
      env("OMPI_COMM_WORLD_SIZE") != nullptr) {
    return fromOpenMpi();
  }
  if (env("SLURM_PROCID") != nullptr) {
    return fromSlurm();
  }
  LaunchEnvironment launch;
  readMaster(Reader(Launcher::kNone), launch);
  return launch;
}

} // namespace rpc
} // namespace torchrpc
