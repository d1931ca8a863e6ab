// The gRPC side of bench/compare: runs one workload with gRPC C++ (a server
// process and a client process on loopback) and prints one JSON line,
//   {"workload": W, "metric": M, "unit": U, "value": x, "better": B,
//    "grpc_version": V}
// Each workload follows the definition torchrpc_bench and pytorch_bench.py
// share (bench/README.md), with tensors as protobuf bytes
// (bench/grpc_bench.proto). gRPC has no counterpart of the workloads on
// RRefs, distributed autograd and the distributed optimizer: for those it
// prints "value": null with an "error" saying so, and exits 0.
//
//   grpc_bench --workload NAME [--quick]

#include <ATen/ATen.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/version_info.h>

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <deque>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_support.h"
#include "bench/grpc_bench.grpc.pb.h"

namespace {

using torchrpc::bench::Bench;
using TensorMessage = torchrpc::bench::Tensor;
using namespace torchrpc::bench;

// Above the largest request (64 MiB of tensor plus its framing): gRPC's
// default receive limit is 4 MiB, which a user shipping tensors raises.
constexpr int kMaxMessageBytes = 128 << 20;
// Every call carries a deadline, as PyTorch's and torchrpc's 60 s default
// timeouts bound theirs.
constexpr auto kCallTimeout = std::chrono::seconds(60);

// No --transport: gRPC's one is HTTP/2 over TCP.
const Program kProgram = {"grpc_bench", "[--quick]", ""};

// What only this side's line carries: which gRPC measured.
std::vector<std::pair<std::string, std::string>> versionKey() {
  return {{"grpc_version", GRPC_CPP_VERSION_STRING}};
}

// ---- tensors as protobuf bytes ---------------------------------------------

// Copies the tensor's bytes into the message: the serialization of a call,
// inside its timed region as on the other two sides.
void toMessage(const at::Tensor& tensor, TensorMessage* message) {
  TORCH_CHECK(
      tensor.scalar_type() == at::kFloat && tensor.is_contiguous(),
      "grpc_bench ships contiguous float32 tensors only");
  message->clear_sizes();
  for (int64_t size : tensor.sizes()) {
    message->add_sizes(size);
  }
  message->set_data(tensor.data_ptr(), tensor.nbytes());
}

// A view of the message's bytes (no copy), valid while the message lives,
// and only read. Empty when the bytes do not match the shape.
std::optional<at::Tensor> viewOf(const TensorMessage& message) {
  std::vector<int64_t> sizes(message.sizes().begin(), message.sizes().end());
  int64_t numel = 1;
  for (int64_t size : sizes) {
    numel *= size;
  }
  if (numel < 0 || message.data().size() != size_t(numel) * sizeof(float)) {
    return std::nullopt;
  }
  // from_blob takes a mutable pointer; nothing writes through the view.
  return at::from_blob(
      const_cast<char*>(message.data().data()),
      sizes,
      at::kFloat);
}

// ---- the server (worker1) ---------------------------------------------------

// Callback API handlers: they finish inline on gRPC's own threads, without
// the hand-off to a thread pool of the synchronous server.
class BenchService final : public Bench::CallbackService {
 public:
  grpc::ServerUnaryReactor* AddOne(
      grpc::CallbackServerContext* context,
      const TensorMessage* request,
      TensorMessage* reply) override {
    auto* reactor = context->DefaultReactor();
    // The request lives until Finish; the view reads it in place.
    auto x = viewOf(*request);
    if (!x) {
      reactor->Finish(malformed());
      return reactor;
    }
    toMessage(*x + 1, reply);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

  grpc::ServerUnaryReactor* Sink(
      grpc::CallbackServerContext* context,
      const TensorMessage* request,
      TensorMessage* reply) override {
    auto* reactor = context->DefaultReactor();
    if (!viewOf(*request)) {
      reactor->Finish(malformed());
      return reactor;
    }
    toMessage(at::zeros({1}), reply);
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  static grpc::Status malformed() {
    return grpc::Status(
        grpc::StatusCode::INVALID_ARGUMENT,
        "tensor bytes do not match its sizes");
  }
};

// Serves until the parent writes to (or closes) stopFd, or until
// lifetimeMs have passed. Reports its port on portFd, as an int.
int runServer(int portFd, int stopFd, int lifetimeMs) {
  BenchService service;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(
      "127.0.0.1:0",
      grpc::InsecureServerCredentials(),
      &port);
  builder.SetMaxReceiveMessageSize(kMaxMessageBytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (!server || port == 0) {
    std::cerr << "grpc_bench worker1: cannot listen on 127.0.0.1\n";
    return 1;
  }
  writeAll(portFd, &port, sizeof(port));
  readWithin(stopFd, 1, lifetimeMs); // blocks without using CPU
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  server->Wait();
  return 0;
}

// ---- the client (worker0) and its workloads ---------------------------------

std::chrono::system_clock::time_point callDeadline() {
  return std::chrono::system_clock::now() + kCallTimeout;
}

std::runtime_error callFailed(const char* method, const grpc::Status& status) {
  return std::runtime_error(
      std::string(method) + " failed: gRPC status " +
      std::to_string(status.error_code()) + ": " + status.error_message());
}

enum class Method { kAddOne, kSink };

// One blocking call with the synchronous stub, from the tensor to the
// reply's tensor (a view of the reply, which the caller keeps).
at::Tensor callSync(
    Bench::Stub& stub,
    Method method,
    const at::Tensor& argument,
    TensorMessage* reply) {
  TensorMessage request;
  toMessage(argument, &request);
  grpc::ClientContext context;
  context.set_deadline(callDeadline());
  const char* name = method == Method::kAddOne ? "AddOne" : "Sink";
  grpc::Status status = method == Method::kAddOne
      ? stub.AddOne(&context, request, reply)
      : stub.Sink(&context, request, reply);
  if (!status.ok()) {
    throw callFailed(name, status);
  }
  auto result = viewOf(*reply);
  if (!result) {
    throw std::runtime_error(std::string(name) + ": malformed reply");
  }
  return *result;
}

double callRtt(Bench::Stub& stub, bool quick) {
  auto x = at::ones({1});
  int warmup = quick ? 100 : 500;
  int timed = quick ? 1000 : 5000;
  TensorMessage reply;
  for (int i = 0; i < warmup; ++i) {
    callSync(stub, Method::kAddOne, x, &reply);
  }
  std::vector<double> times;
  times.reserve(timed);
  for (int i = 0; i < timed; ++i) {
    auto start = Clock::now();
    callSync(stub, Method::kAddOne, x, &reply);
    times.push_back(microsSince(start));
  }
  printDistribution("call_rtt_1elem", times);
  return median(times);
}

// A FIFO window of at most 64 calls outstanding on one completion queue,
// which this thread drives itself (no callback thread to wake it up).
class CallWindow {
 public:
  explicit CallWindow(Bench::Stub& stub) : stub_(stub) {}

  CallWindow(const CallWindow&) = delete;
  CallWindow& operator=(const CallWindow&) = delete;

  // Fails what is still outstanding (when a call failed or timed out) and
  // drains the queue, which gRPC requires before destroying it; cancelled
  // calls complete promptly.
  ~CallWindow() {
    for (auto& call : window_) {
      call->context.TryCancel();
    }
    queue_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (queue_.Next(&tag, &ok)) {
    }
  }

  size_t size() const {
    return window_.size();
  }

  void issue(const at::Tensor& x) {
    auto call = std::make_unique<PendingCall>();
    call->context.set_deadline(callDeadline());
    TensorMessage request;
    toMessage(x, &request);
    // The request is serialized when the call starts: it may go now.
    call->reader = stub_.AsyncAddOne(&call->context, request, &queue_);
    call->reader->Finish(&call->reply, &call->status, call.get());
    window_.push_back(std::move(call));
  }

  // Waits until the oldest call has completed, then retires it.
  void retireOldest() {
    PendingCall& oldest = *window_.front();
    while (!oldest.done) {
      void* tag = nullptr;
      bool ok = false;
      auto next = queue_.AsyncNext(&tag, &ok, callDeadline());
      if (next != grpc::CompletionQueue::GOT_EVENT) {
        throw std::runtime_error("no call completed within 60 s");
      }
      static_cast<PendingCall*>(tag)->done = true;
    }
    if (!oldest.status.ok()) {
      throw callFailed("AddOne", oldest.status);
    }
    if (!viewOf(oldest.reply)) {
      throw std::runtime_error("AddOne: malformed reply");
    }
    window_.pop_front();
  }

 private:
  struct PendingCall {
    grpc::ClientContext context;
    TensorMessage reply;
    grpc::Status status;
    std::unique_ptr<grpc::ClientAsyncResponseReader<TensorMessage>> reader;
    bool done = false;
  };

  Bench::Stub& stub_;
  grpc::CompletionQueue queue_;
  std::deque<std::unique_ptr<PendingCall>> window_;
};

// Issues `calls` calls with at most 64 outstanding; returns the seconds
// taken.
double pipelined(Bench::Stub& stub, int calls) {
  auto x = at::ones({1});
  CallWindow window(stub);
  auto start = Clock::now();
  int issued = 0;
  while (issued < calls && window.size() < 64) {
    window.issue(x);
    ++issued;
  }
  while (window.size() > 0) {
    window.retireOldest();
    if (issued < calls) {
      window.issue(x);
      ++issued;
    }
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double callsPerSecond(Bench::Stub& stub, bool quick) {
  pipelined(stub, quick ? 500 : 2000);
  int calls = quick ? 3000 : 20000;
  return calls / pipelined(stub, calls);
}

double bandwidth(Bench::Stub& stub, size_t bytes, bool quick) {
  bool big = bytes > (8u << 20);
  int warmup = big ? (quick ? 1 : 2) : (quick ? 3 : 5);
  int timed = big ? (quick ? 5 : 20) : (quick ? 10 : 50);
  auto t = at::rand({static_cast<int64_t>(bytes / 4)});
  TensorMessage reply;
  for (int i = 0; i < warmup; ++i) {
    callSync(stub, Method::kSink, t, &reply);
  }
  std::vector<double> times;
  for (int i = 0; i < timed; ++i) {
    auto start = Clock::now();
    callSync(stub, Method::kSink, t, &reply);
    times.push_back(microsSince(start));
  }
  double total = 0;
  for (double us : times) {
    total += us;
  }
  std::cerr << "aggregate: " << bytes * timed / (total * 1e3) << " GB/s\n";
  printDistribution("per call", times);
  return bytes / (median(times) * 1e3);
}

// What the client tells the parent, in one write (atomic on a pipe): a kind
// byte, then a double for kValue or the reason for kError.
constexpr char kValue = 'v';
constexpr char kReady = 'r';
constexpr char kError = 'e';
constexpr size_t kReportBytes = 512; // < PIPE_BUF

void report(int fd, char kind, const std::string& payload) {
  std::string message = kind + payload.substr(0, kReportBytes - 1);
  writeAll(fd, message.data(), message.size());
}

// Runs the workload against the server on `port`; reports to resultFd. For
// idle_cpu_cores it then blocks on goFd until the parent has measured.
int runClient(const Settings& s, int port, int resultFd, int goFd) {
  try {
    grpc::ChannelArguments arguments;
    arguments.SetMaxReceiveMessageSize(kMaxMessageBytes);
    arguments.SetMaxSendMessageSize(kMaxMessageBytes);
    auto channel = grpc::CreateCustomChannel(
        "127.0.0.1:" + std::to_string(port),
        grpc::InsecureChannelCredentials(),
        arguments);
    if (!channel->WaitForConnected(
            std::chrono::system_clock::now() + std::chrono::seconds(30))) {
      throw std::runtime_error(
          "no connection to 127.0.0.1:" + std::to_string(port) +
          " within 30 s");
    }
    auto stub = Bench::NewStub(channel);
    double value = 0;
    if (s.workload == "idle_cpu_cores") {
      TensorMessage reply;
      callSync(*stub, Method::kAddOne, at::ones({1}), &reply);
      report(resultFd, kReady, "");
      readWithin(goFd, 1, 120000); // blocks without using CPU
      return 0;
    } else if (s.workload == "call_rtt_1elem") {
      value = callRtt(*stub, s.quick);
    } else if (s.workload == "calls_per_s_64_outstanding") {
      value = callsPerSecond(*stub, s.quick);
    } else if (s.workload == "bandwidth_4MiB") {
      value = bandwidth(*stub, size_t(4) << 20, s.quick);
    } else if (s.workload == "bandwidth_64MiB") {
      value = bandwidth(*stub, size_t(64) << 20, s.quick);
    } else {
      throw std::runtime_error("no gRPC driver for " + s.workload);
    }
    report(resultFd, kValue, std::string(reinterpret_cast<char*>(&value), 8));
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "grpc_bench worker0: " << e.what() << "\n";
    report(resultFd, kError, std::string("worker0: ") + e.what());
    return 1;
  }
}

// ---- the parent -------------------------------------------------------------

// Starts worker1 (the server), then worker0 (the client) and returns the
// value, or throws with the reason the run failed.
double runWorkload(const Settings& s) {
  int limitMs = resultTimeoutMs(s);
  int portPipe[2];
  int stopPipe[2];
  int resultPipe[2];
  int goPipe[2];
  if (::pipe(portPipe) != 0 || ::pipe(stopPipe) != 0 ||
      ::pipe(resultPipe) != 0 || ::pipe(goPipe) != 0) {
    throw std::runtime_error(std::string("pipe: ") + std::strerror(errno));
  }
  // Each child keeps only its own ends, so a child that dies shows up as an
  // end of file in the parent instead of a timeout.
  auto closeAll = [](std::initializer_list<int> fds) {
    for (int fd : fds) {
      ::close(fd);
    }
  };
  WorkerProcesses workers;
  pid_t server = workers.fork([&]() {
    closeAll({portPipe[0], stopPipe[1], resultPipe[0], resultPipe[1]});
    closeAll({goPipe[0], goPipe[1]});
    try {
      return runServer(portPipe[1], stopPipe[0], limitMs + 60000);
    } catch (const std::exception& e) {
      std::cerr << "grpc_bench worker1: " << e.what() << "\n";
      return 1;
    }
  });
  ::close(portPipe[1]);
  ::close(stopPipe[0]);
  if (server < 0) {
    throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  }
  int port = 0;
  if (!readExactlyWithin(portPipe[0], &port, sizeof(port), 60000)) {
    throw std::runtime_error("worker1 (the server) did not start");
  }

  pid_t client = workers.fork([&]() {
    closeAll({portPipe[0], stopPipe[1], resultPipe[0], goPipe[1]});
    return runClient(s, port, resultPipe[1], goPipe[0]);
  });
  ::close(resultPipe[1]);
  ::close(goPipe[0]);
  if (client < 0) {
    throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  }

  std::string message = readWithin(resultPipe[0], kReportBytes, limitMs);
  double value = 0;
  if (message.empty()) {
    throw std::runtime_error("worker0 exited or timed out without a result");
  } else if (message[0] == kError) {
    throw std::runtime_error(message.substr(1));
  } else if (message[0] == kReady) {
    IdleCpu idle = measureIdleCpu({client, server}, s.quick);
    value = idle.cores;
    std::cerr << "idle: worker0 and worker1 used " << idle.cpuSeconds
              << " CPU s\n";
    char go = 1;
    writeAll(goPipe[1], &go, 1);
  } else if (message[0] == kValue && message.size() == 1 + sizeof(value)) {
    std::memcpy(&value, message.data() + 1, sizeof(value));
  } else {
    throw std::runtime_error("worker0 sent a malformed report");
  }
  char stop = 1;
  writeAll(stopPipe[1], &stop, 1);
  workers.awaitExit(10000);
  return value;
}

} // namespace

int main(int argc, char** argv) {
  Settings s = parseCommandLine(kProgram, argc, argv);
  // Workloads on PyTorch RPC's higher layers: a gRPC user would have to
  // build those layers first, so there is nothing to measure.
  static const std::vector<std::pair<std::string, std::string>> kNoEquivalent =
      {
          {"remote_to_here_rtt",
           "no gRPC equivalent: gRPC has no remote references (RRef)"},
          {"rref_create_delete_per_s",
           "no gRPC equivalent: gRPC has no remote references (RRef)"},
          {"dist_autograd_overhead",
           "no gRPC equivalent: gRPC has no distributed autograd"},
          {"dist_optimizer_step",
           "no gRPC equivalent: gRPC has no distributed autograd or "
           "distributed optimizer"},
          {"ps_steps_per_s_vs_local",
           "no gRPC equivalent: gRPC has no remote modules, distributed "
           "autograd or distributed optimizer"},
      };
  for (const auto& [workload, reason] : kNoEquivalent) {
    if (workload == s.workload) {
      printResultLine(s, std::nullopt, versionKey(), reason);
      return 0;
    }
  }
  // Writing to a worker that already died must fail, not kill the parent.
  ::signal(SIGPIPE, SIG_IGN);
  // NB: no gRPC object exists in this process before the forks: gRPC's
  // threads and descriptors do not survive a fork.
  try {
    double value = runWorkload(s);
    printResultLine(s, value, versionKey());
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "grpc_bench: " << e.what() << "\n";
    printResultLine(s, std::nullopt, versionKey(), e.what());
    return 1;
  }
}
