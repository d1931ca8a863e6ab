// Transport micro-measurement: TcpTransport against TensorPipeTransport,
// each client in this process talking to an echo server in a forked child
// over loopback. Prints, per transport, the small-message round trip
// (median, p90), the time to send 64 MiB one way, and the CPU an idle
// connected pair burns. Exits 1 if a measurement failed, or if an idle TCP
// pair uses more than 2% of a core (heartbeats only should cost nothing).
// Moved out of the unit tests (tests/rpc/transport/tcp/): it asserts
// nothing about speed, and a shared machine makes its figures noisy.
//
//   BUILD_DIR/bench/transport_microbench

#include <ATen/ATen.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/tcp_peers.h"
#include "tests/support/transport_harness.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"
#include "torchrpc/rpc/transport/tensorpipe/tensorpipe_transport.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace harness;
using ChildServer = harness::ChildServer;

double cpuSecondsOf(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string content((std::istreambuf_iterator<char>(stat)), {});
  // Fields after the command name (which may contain spaces).
  std::istringstream rest(content.substr(content.rfind(')') + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14 || i == 15) { // utime, stime
      ticks += std::stod(field);
    }
  }
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

struct Measurement {
  double rttMedianUs = 0;
  double rttP90Us = 0;
  double bigMs = 0;
  double idleCores = 0;
  double idleChildCores = 0;
  std::string error; // empty: measured
};

Measurement measure(ChildServer::Kind kind) {
  Measurement result;
  ChildServer child(kind, harness::testOptions("child"));
  if (child.address().empty()) {
    result.error = "the child server did not start";
    return result;
  }
  std::unique_ptr<Transport> client;
  if (kind == ChildServer::Kind::kTcp) {
    client =
        std::make_unique<detail::TcpTransport>(harness::testOptions("client"));
  } else {
    client = std::make_unique<detail::TensorPipeTransport>(
        detail::TensorPipeTransportOptions{});
  }
  std::shared_ptr<Connection> connection;
  connection = client->connect(child.address());
  auto inbox = startWithInbox(connection);
  connection->send(makeMessage("hello"), [](const TransportError*) {});
  if (!inbox->waitForMessages(1, kTimeout)) {
    result.error = "no echo from the child server";
    return result;
  }

  // Small round trips: the caller waits as rpcSync does.
  at::Tensor small = at::arange(4, at::kFloat);
  std::vector<double> samples;
  size_t expected = 1;
  for (int i = 0; i < 3000; ++i) {
    auto start = Clock::now();
    connection->send(
        makeMessage(std::string(64, 'r'), {small}),
        [](const TransportError*) {});
    if (!inbox->waitForMessages(++expected, kTimeout)) {
      result.error = "round trip " + std::to_string(i) + " timed out";
      return result;
    }
    if (i >= 500) { // warm-up
      samples.push_back(
          std::chrono::duration<double, std::micro>(Clock::now() - start)
              .count());
    }
  }
  std::sort(samples.begin(), samples.end());
  result.rttMedianUs = samples[samples.size() / 2];
  result.rttP90Us = samples[samples.size() * 9 / 10];

  // 64 MiB one way, acknowledged by a small message; best of 5.
  at::Tensor big = at::ones({64 << 20}, at::kByte);
  result.bigMs = 1e9;
  for (int i = 0; i < 5; ++i) {
    auto start = Clock::now();
    connection->send(makeMessage("ack", {big}), [](const TransportError*) {});
    if (!inbox->waitForMessages(++expected, kTimeout)) {
      result.error = "64 MiB transfer timed out";
      return result;
    }
    result.bigMs = std::min(
        result.bigMs,
        std::chrono::duration<double, std::milli>(Clock::now() - start)
            .count());
  }

  // Idle CPU of a connected pair.
  constexpr auto kIdle = 3s;
  double selfBefore = cpuSecondsOf(::getpid());
  double childBefore = cpuSecondsOf(child.pid());
  std::this_thread::sleep_for(kIdle);
  double seconds = std::chrono::duration<double>(kIdle).count();
  result.idleCores = (cpuSecondsOf(::getpid()) - selfBefore) / seconds;
  result.idleChildCores = (cpuSecondsOf(child.pid()) - childBefore) / seconds;
  if (!inbox->errors().empty()) {
    result.error = inbox->errors()[0].detail;
  }
  return result;
}

} // namespace
} // namespace rpc
} // namespace torchrpc

int main() {
  using torchrpc::rpc::ChildServer;
  using torchrpc::rpc::Measurement;
  int status = 0;
  for (auto kind : {ChildServer::Kind::kTcp, ChildServer::Kind::kTensorPipe}) {
    const char* name = kind == ChildServer::Kind::kTcp ? "TcpTransport       "
                                                       : "TensorPipeTransport";
    Measurement m = torchrpc::rpc::measure(kind);
    if (!m.error.empty()) {
      std::cerr << name << ": " << m.error << std::endl;
      status = 1;
      continue;
    }
    std::cout << name << "  small RTT median " << m.rttMedianUs << " us, p90 "
              << m.rttP90Us << " us;  64 MiB one-way " << m.bigMs << " ms ("
              << (64.0 / 1024) / (m.bigMs / 1000) << " GiB/s);  idle cores "
              << m.idleCores << " (client) " << m.idleChildCores << " (server)"
              << std::endl;
    if (kind == ChildServer::Kind::kTcp &&
        m.idleCores + m.idleChildCores >= 0.02) {
      std::cerr << "an idle TCP pair uses more than heartbeats should"
                << std::endl;
      status = 1;
    }
  }
  return status;
}
