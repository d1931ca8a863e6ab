#include "torchrpc/rpc/options.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <optional>
#include <string>

#include "torchrpc/rpc/trace_steps.h"

namespace torchrpc {
namespace rpc {

namespace {

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? value : nullptr;
}

int64_t envInt(const char* name, int64_t fallback) {
  const char* value = env(name);
  if (value == nullptr) {
    return fallback;
  }
  char* end = nullptr;
  errno = 0;
  long long parsed = std::strtoll(value, &end, 10);
  TORCH_CHECK(
      end != value && *end == '\0',
      "environment variable ",
      name,
      " must be an integer, got '",
      value,
      "'");
  // strtoll clamps what does not fit, which would pass for a choice.
  TORCH_CHECK(
      errno != ERANGE,
      "environment variable ",
      name,
      " must be an integer that fits in 64 bits, got '",
      value,
      "'");
  return parsed;
}

// A byte count: an integer, not negative.
size_t envBytes(const char* name, size_t fallback) {
  int64_t bytes = envInt(name, static_cast<int64_t>(fallback));
  TORCH_CHECK(
      bytes >= 0,
      "environment variable ",
      name,
      " must be a byte count, not negative, got '",
      env(name),
      "'");
  return static_cast<size_t>(bytes);
}

bool envFlag(const char* name, bool fallback) {
  const char* value = env(name);
  if (value == nullptr) {
    return fallback;
  }
  std::string flag = value;
  TORCH_CHECK(
      flag == "0" || flag == "1",
      "environment variable ",
      name,
      " must be 1 or 0, got '",
      value,
      "'");
  return flag == "1";
}

} // namespace

Options Options::fromEnvironment() {
  Options options;
  options.launch = LaunchEnvironment::fromEnvironment();
  options.rank = options.launch.rank;
  options.worldSize = options.launch.worldSize;
  if (const char* method = env("TORCHRPC_INIT_METHOD")) {
    options.initMethod = method;
  }
  if (const char* address = env("TORCHRPC_LISTEN_ADDR")) {
    options.listenAddress = address;
  }
  int64_t threads = envInt(
      "TORCHRPC_NUM_THREADS",
      static_cast<int64_t>(options.numWorkerThreads));
  TORCH_CHECK(threads >= 1, "TORCHRPC_NUM_THREADS must be at least 1");
  options.numWorkerThreads = static_cast<size_t>(threads);
  options.defaultTimeout = std::chrono::milliseconds(
      envInt("TORCHRPC_TIMEOUT_MS", options.defaultTimeout.count()));
  int64_t spin = envInt("TORCHRPC_SPIN_US", options.spinAfterWork.count());
  TORCH_CHECK(spin >= 0, "TORCHRPC_SPIN_US must not be negative");
  options.spinAfterWork = std::chrono::microseconds(spin);
  int64_t poll =
      envInt("TORCHRPC_IO_POLL_US", options.ioPollAfterTraffic.count());
  TORCH_CHECK(poll >= 0, "TORCHRPC_IO_POLL_US must not be negative");
  options.ioPollAfterTraffic = std::chrono::microseconds(poll);
  int64_t pollAwaiting =
      envInt("TORCHRPC_IO_POLL_AWAIT_US", options.ioPollWhileAwaiting.count());
  TORCH_CHECK(
      pollAwaiting >= 0,
      "TORCHRPC_IO_POLL_AWAIT_US must not be negative");
  options.ioPollWhileAwaiting = std::chrono::microseconds(pollAwaiting);
  options.sameHostTransfers =
      envFlag("TORCHRPC_SAME_HOST", options.sameHostTransfers);
  options.sharedMemoryMaxBytes = envBytes(
      "TORCHRPC_SHARED_MEMORY_MAX_BYTES",
      options.sharedMemoryMaxBytes);
  options.copyHelperMinBytes =
      envBytes("TORCHRPC_COPY_HELPER_MIN_BYTES", options.copyHelperMinBytes);
  options.sharedRingBytes =
      envBytes("TORCHRPC_SHARED_RING_BYTES", options.sharedRingBytes);
  if (const char* transport = env("TORCHRPC_TRANSPORT")) {
    std::string name = transport;
    if (name == "tcp") {
      options.transport = TransportKind::kTcp;
    } else if (name == "tensorpipe") {
      options.transport = TransportKind::kTensorPipe;
    } else if (name == "tensorpipe-shm") {
      options.transport = TransportKind::kTensorPipe;
      options.tensorpipeTransports = {"shm", "uv"};
    } else {
      TORCH_CHECK(
          false,
          "TORCHRPC_TRANSPORT must be tcp, tensorpipe or tensorpipe-shm, "
          "got '",
          name,
          "'");
    }
  }
  if (const char* secret = env("TORCHRPC_SHARED_SECRET")) {
    options.sharedSecret = secret;
  }
  options.peerTimeout = std::chrono::milliseconds(
      envInt("TORCHRPC_PEER_TIMEOUT_MS", options.peerTimeout.count()));
  int64_t rendezvousMs = envInt(
      "TORCHRPC_RENDEZVOUS_TIMEOUT_MS",
      options.rendezvousTimeout.count());
  TORCH_CHECK(
      rendezvousMs > 0,
      "TORCHRPC_RENDEZVOUS_TIMEOUT_MS must be positive");
  options.rendezvousTimeout = std::chrono::milliseconds(rendezvousMs);
  if (const char* storeAddress = std::getenv("TORCHRPC_STORE_LISTEN_ADDR")) {
    options.storeListenAddress = storeAddress;
  }
  if (const char* directory = env("TORCHRPC_TRACE_DIR")) {
    options.traceDirectory = directory;
  }
  if (const char* window = env("TORCHRPC_TRACE_STEPS")) {
    // The launcher's --trace-steps reads the same syntax (trace_steps.h).
    std::optional<TraceStepWindow> steps = parseTraceSteps(window);
    TORCH_CHECK(
        steps.has_value(),
        "TORCHRPC_TRACE_STEPS must be ",
        kTraceStepsSyntax,
        ", got '",
        window,
        "'");
    options.traceFirstStep = steps->first;
    options.traceStepCount = steps->count;
  }
  int64_t maxEvents = envInt(
      "TORCHRPC_TRACE_MAX_EVENTS",
      static_cast<int64_t>(options.traceMaxEvents));
  TORCH_CHECK(
      maxEvents >= 0,
      "TORCHRPC_TRACE_MAX_EVENTS must not be negative, got '",
      // Set: the default is not negative.
      env("TORCHRPC_TRACE_MAX_EVENTS"),
      "'");
  options.traceMaxEvents = static_cast<size_t>(maxEvents);
  if (const char* metrics = env("TORCHRPC_METRICS_ADDR")) {
    options.metricsAddress = metrics;
  }
  if (const char* signal = env("TORCHRPC_HANG_REPORT_SIGNAL")) {
    std::string name = signal;
    if (name.rfind("SIG", 0) == 0) {
      name = name.substr(3);
    }
    TORCH_CHECK(
        name == "USR1" || name == "USR2",
        "TORCHRPC_HANG_REPORT_SIGNAL must be USR1 or USR2 (or empty for "
        "none), got '",
        signal,
        "'");
    options.hangReportSignal = name == "USR1" ? SIGUSR1 : SIGUSR2;
  }
  return options;
}

} // namespace rpc
} // namespace torchrpc
