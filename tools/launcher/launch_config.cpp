#include "launch_config.h"

#include <CLI/CLI.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>

#include "torchrpc/rpc/trace_steps.h"

namespace torchrpc {
namespace launcher {

std::map<std::string, std::string> LaunchConfig::workerEnvironment(
    int localRank,
    int restartCount) const {
  std::map<std::string, std::string> environment = {
      {"RANK", std::to_string(nodeRank * nprocPerNode + localRank)},
      {"LOCAL_RANK", std::to_string(localRank)},
      {"WORLD_SIZE", std::to_string(worldSize())},
      {"LOCAL_WORLD_SIZE", std::to_string(nprocPerNode)},
      {"GROUP_RANK", std::to_string(nodeRank)},
      {"GROUP_WORLD_SIZE", std::to_string(nnodes)},
      {"ROLE_RANK", std::to_string(nodeRank * nprocPerNode + localRank)},
      {"ROLE_WORLD_SIZE", std::to_string(worldSize())},
      {"ROLE_NAME", "default"},
      {"MASTER_ADDR", masterAddr},
      {"MASTER_PORT", std::to_string(masterPort)},
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restartCount)},
      {"TORCHELASTIC_MAX_RESTARTS", std::to_string(maxRestarts)},
      {"TORCHELASTIC_RUN_ID", runId},
      // Rank 0 hosts the store: there is no agent store to join.
      {"TORCHELASTIC_USE_AGENT_STORE", "False"},
  };
  if (!traceDir.empty()) {
    environment["TORCHRPC_TRACE_DIR"] = traceDir;
  }
  if (!traceSteps.empty()) {
    environment["TORCHRPC_TRACE_STEPS"] = traceSteps;
  }
  if (setsHangReportSignal) {
    environment["TORCHRPC_HANG_REPORT_SIGNAL"] = "USR1";
  }
  if (metricsPort > 0) {
    environment["TORCHRPC_METRICS_ADDR"] =
        metricsHost + ":" + std::to_string(metricsPort + localRank);
  }
  return environment;
}

namespace {

// torchrun's --nnodes: "N", or "MIN:MAX" for elastic jobs. A fixed group is
// all torchrpc-launch runs, so MIN:MAX must name one number.
int parseNnodes(const std::string& text) {
  auto number = [&text](const std::string& part) {
    size_t used = 0;
    int value = 0;
    try {
      value = std::stoi(part, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != part.size() || value < 1) {
      throw CLI::ValidationError(
          "--nnodes",
          "expects N or N:N with N >= 1, got '" + text + "'");
    }
    return value;
  };
  size_t colon = text.find(':');
  if (colon == std::string::npos) {
    return number(text);
  }
  int low = number(text.substr(0, colon));
  int high = number(text.substr(colon + 1));
  if (low != high) {
    throw CLI::ValidationError(
        "--nnodes",
        "an elastic range (" + text +
            ") is not supported: torchrpc-launch runs a fixed group of "
            "nodes; give one number");
  }
  return low;
}

} // namespace

bool parseCommandLine(
    int argc,
    char** argv,
    LaunchConfig& config,
    int& exitCode) {
  CLI::App app(
      "Starts the workers of a torchrpc job on this node with torchrun's "
      "environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), prefixes "
      "their output with their rank, stops them all when one fails, and "
      "restarts the group up to --max-restarts times. `kill -USR1` on the "
      "launcher prints the job's hang report (the lowest running rank's "
      "stderr; workers get TORCHRPC_HANG_REPORT_SIGNAL=USR1 unless it is "
      "set, and empty turns it off).",
      "torchrpc-launch");
  // Everything from the program on belongs to the program.
  app.prefix_command();
  double graceSeconds = 5.0;
  std::string nnodes = "1";
  app.add_option(
      "--nnodes",
      nnodes,
      "number of nodes: N, or torchrun's N:N (an elastic MIN:MAX range is "
      "refused)");
  app.add_option(
         "--nproc-per-node,--nproc_per_node",
         config.nprocPerNode,
         "workers on this node")
      ->check(CLI::PositiveNumber);
  app.add_option(
         "--node-rank,--node_rank",
         config.nodeRank,
         "this node's index")
      ->check(CLI::NonNegativeNumber);
  app.add_option(
      "--master-addr,--master_addr",
      config.masterAddr,
      "address of the node whose rank 0 hosts the rendezvous store");
  app.add_option(
         "--master-port,--master_port",
         config.masterPort,
         "port of the rendezvous store")
      ->check(CLI::Range(1, 65535));
  app.add_flag(
      "--standalone",
      config.standalone,
      "one node: master 127.0.0.1 on a free port");
  app.add_option(
         "--max-restarts,--max_restarts",
         config.maxRestarts,
         "restarts of the group after a failure")
      ->check(CLI::NonNegativeNumber);
  app.add_option(
      "--log-dir,--log_dir",
      config.logDir,
      "write <dir>/attempt_<k>/<rank>/{stdout,stderr}.log");
  app.add_option(
      "--run-id,--run_id",
      config.runId,
      "TORCHELASTIC_RUN_ID of the workers");
  app.add_option(
      "--trace-dir",
      config.traceDir,
      "every worker traces and writes <dir>/<worker>.trace.json at shutdown "
      "(TORCHRPC_TRACE_DIR; merge them with torchrpc-trace-merge)");
  app.add_option(
         "--trace-steps",
         config.traceSteps,
         "with --trace-dir, trace only steps FIRST:COUNT (TORCHRPC_TRACE_STEPS)")
      ->check(CLI::Validator(
          [](std::string& value) -> std::string {
            // What a worker would refuse in TORCHRPC_TRACE_STEPS is refused
            // here, before any worker starts.
            if (!rpc::parseTraceSteps(value)) {
              return std::string("must be ") + rpc::kTraceStepsSyntax;
            }
            return "";
          },
          "FIRST:COUNT"));
  app.add_option(
         "--metrics-port",
         config.metricsPort,
         "serve each worker's metrics (Prometheus) at "
         "http://HOST:PORT+LOCAL_RANK/metrics (TORCHRPC_METRICS_ADDR)")
      ->check(CLI::Range(1, 65535));
  app.add_option(
      "--metrics-host",
      config.metricsHost,
      "the address --metrics-port binds (default 127.0.0.1)");
  app.add_option(
         "--stop-grace-seconds",
         graceSeconds,
         "time between SIGTERM and SIGKILL when stopping workers")
      ->check(CLI::NonNegativeNumber);
  try {
    app.parse(argc, argv);
    config.command = app.remaining();
    if (!config.command.empty() && config.command.front() == "--") {
      config.command.erase(config.command.begin());
    }
    if (config.command.empty()) {
      throw CLI::ValidationError("PROGRAM", "no program to run was given");
    }
    config.nnodes = parseNnodes(nnodes);
    if (config.standalone) {
      if (config.nnodes != 1 || config.nodeRank != 0) {
        throw CLI::ValidationError(
            "--standalone",
            "means one node: --nnodes 1 --node-rank 0");
      }
      config.masterAddr = "127.0.0.1";
      config.masterPort = findFreePort();
      if (config.runId == "none") {
        std::random_device random;
        std::ostringstream id;
        id << std::hex << random() << random();
        config.runId = id.str();
      }
    }
    if (config.nodeRank >= config.nnodes) {
      throw CLI::ValidationError("--node-rank", "must be below --nnodes");
    }
    if (!config.traceSteps.empty() && config.traceDir.empty()) {
      throw CLI::ValidationError("--trace-steps", "needs --trace-dir");
    }
    if (config.metricsPort > 0 &&
        config.metricsPort + config.nprocPerNode - 1 > 65535) {
      throw CLI::ValidationError(
          "--metrics-port",
          "leaves no port for every local rank");
    }
  } catch (const CLI::ParseError& e) {
    exitCode = app.exit(e);
    return false;
  }
  config.stopGrace =
      std::chrono::milliseconds(static_cast<int64_t>(graceSeconds * 1000));
  if (const char* signal = std::getenv("TORCHRPC_HANG_REPORT_SIGNAL")) {
    std::string name = signal;
    if (name.rfind("SIG", 0) == 0) {
      name = name.substr(3);
    }
    config.hangReportSignal =
        name == "USR1" ? SIGUSR1 : (name == "USR2" ? SIGUSR2 : 0);
  } else {
    config.hangReportSignal = SIGUSR1;
    config.setsHangReportSignal = true;
  }
  return true;
}

int findFreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    throw std::runtime_error("socket() failed looking for a free port");
  }
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  bool ok =
      ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  ::close(fd);
  if (!ok) {
    throw std::runtime_error("could not bind 127.0.0.1:0 for a free port");
  }
  return ntohs(address.sin_port);
}

} // namespace launcher
} // namespace torchrpc
