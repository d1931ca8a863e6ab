// The torchrpc side of bench/compare: runs one workload with two worker
// processes (three for dist_optimizer_step and ps_steps_per_s_vs_local) on
// loopback and prints one JSON line,
//   {"workload": W, "metric": M, "unit": U, "value": x, "better": B,
//    "transport": T}
// Each workload mirrors bench/pytorch_bench.py exactly (see bench/README.md).
//
//   torchrpc_bench --workload NAME [--transport tcp|tensorpipe|tensorpipe-shm]
//                  [--quick]

#include <ATen/ATen.h>
#include <torch/torch.h>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <functional>
#include <iostream>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "bench/bench_support.h"
#include "bench/split_training.h"
#include "torchrpc/torchrpc.h"

namespace {

using torchrpc::RRef;
using torchrpc::Runtime; // with the RRef layer installed
using torchrpc::rpc::Options;
using namespace torchrpc::bench;

const Program kProgram = {
    "torchrpc_bench",
    "[--transport tcp|tensorpipe|tensorpipe-shm] [--quick]",
    "tcp", // the runtime's default transport
};

// Workers of a workload: worker0 drives, the others serve.
int worldSize(const std::string& workload) {
  return workload == "dist_optimizer_step" ||
          workload == "ps_steps_per_s_vs_local"
      ? 3
      : 2;
}

// TORCHRPC_* variables (threads, spin, ...) apply; the job's shape and the
// rendezvous are the benchmark's own.
Options workerOptions(int rank, const Settings& s, const std::string& store) {
  Options o = Options::fromEnvironment();
  o.rank = rank;
  o.worldSize = worldSize(s.workload);
  o.initMethod = "file://" + store;
  if (s.transport == "tcp") {
    o.transport = torchrpc::rpc::TransportKind::kTcp;
  } else if (s.transport == "tensorpipe") {
    o.transport = torchrpc::rpc::TransportKind::kTensorPipe;
    o.tensorpipeTransports = {"uv"};
  } else if (s.transport == "tensorpipe-shm") {
    o.transport = torchrpc::rpc::TransportKind::kTensorPipe;
    o.tensorpipeTransports = {"shm", "uv"};
  } else {
    usage(kProgram, "unknown transport '" + s.transport + "'");
  }
  o.rendezvousTimeout = std::chrono::seconds(60);
  o.shutdownTimeout = std::chrono::seconds(60);
  return o;
}

// ---- the workloads, run on worker0 -----------------------------------------

double callRtt(Runtime& rt, bool quick) {
  auto x = at::ones({1});
  int warmup = quick ? 100 : 500;
  int timed = quick ? 1000 : 5000;
  for (int i = 0; i < warmup; ++i) {
    rt.rpcSync<at::Tensor>("worker1", "add_one", x);
  }
  std::vector<double> times;
  times.reserve(timed);
  for (int i = 0; i < timed; ++i) {
    auto start = Clock::now();
    rt.rpcSync<at::Tensor>("worker1", "add_one", x);
    times.push_back(microsSince(start));
  }
  printDistribution("call_rtt_1elem", times);
  return median(times);
}

// A FIFO window of at most 64 outstanding calls; returns the seconds taken.
double pipelined(Runtime& rt, int calls) {
  auto x = at::ones({1});
  std::deque<torchrpc::rpc::Future<at::Tensor>> window;
  auto start = Clock::now();
  int issued = 0;
  while (issued < calls && window.size() < 64) {
    window.push_back(rt.rpcAsync<at::Tensor>("worker1", "add_one", x));
    ++issued;
  }
  while (!window.empty()) {
    window.front().wait();
    window.pop_front();
    if (issued < calls) {
      window.push_back(rt.rpcAsync<at::Tensor>("worker1", "add_one", x));
      ++issued;
    }
  }
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double callsPerSecond(Runtime& rt, bool quick) {
  pipelined(rt, quick ? 500 : 2000);
  int calls = quick ? 3000 : 20000;
  return calls / pipelined(rt, calls);
}

double bandwidth(Runtime& rt, size_t bytes, bool quick) {
  bool big = bytes > (8u << 20);
  int warmup = big ? (quick ? 1 : 2) : (quick ? 3 : 5);
  int timed = big ? (quick ? 5 : 20) : (quick ? 10 : 50);
  auto t = at::rand({static_cast<int64_t>(bytes / 4)});
  for (int i = 0; i < warmup; ++i) {
    rt.rpcSync<at::Tensor>("worker1", "sink", t);
  }
  std::vector<double> times;
  for (int i = 0; i < timed; ++i) {
    auto start = Clock::now();
    rt.rpcSync<at::Tensor>("worker1", "sink", t);
    times.push_back(microsSince(start));
  }
  double total = 0;
  for (double us : times) {
    total += us;
  }
  std::cerr << "aggregate: " << bytes * timed / (total * 1e3) << " GB/s\n";
  return bytes / (median(times) * 1e3);
}

double remoteToHereRtt(Runtime& rt, bool quick) {
  auto x = at::ones({1});
  int warmup = quick ? 50 : 200;
  int timed = quick ? 500 : 2000;
  for (int i = 0; i < warmup; ++i) {
    rt.remote<at::Tensor>("worker1", "add_one", x).toHere();
  }
  std::vector<double> times;
  times.reserve(timed);
  for (int i = 0; i < timed; ++i) {
    auto start = Clock::now();
    RRef<at::Tensor> rref = rt.remote<at::Tensor>("worker1", "add_one", x);
    rref.toHere();
    times.push_back(microsSince(start));
    // Dropped here, after the clock stopped: its deletion overlaps the next
    // iterations, as on the PyTorch side.
  }
  return median(times);
}

// Polls until every RRef of the run is fully deleted: worker0 holds no fork
// (each deletion was acknowledged) and worker1 owns no RRef. Returns the
// number of polls.
int waitRRefsGone(Runtime& rt) {
  auto deadline = Clock::now() + std::chrono::seconds(20);
  for (int polls = 1;; ++polls) {
    size_t users = rt.rrefs().counters().userRRefs;
    int64_t owned = -1;
    if (users == 0) {
      owned = rt.rpcSync<int64_t>("worker1", "owner_rref_count");
      if (owned == 0) {
        return polls;
      }
    }
    if (Clock::now() > deadline) {
      throw std::runtime_error(
          "RRefs not deleted after 20 s: worker0 holds " +
          std::to_string(users) + " forks, worker1 owns " +
          (owned < 0 ? std::string("?") : std::to_string(owned)));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}

// Batches of 64: create, wait until the owner has acknowledged every
// creation, drop them all; then wait until all are deleted. Returns the
// seconds taken.
double rrefChurn(Runtime& rt, int total, int* polls) {
  auto x = at::ones({1});
  std::vector<RRef<at::Tensor>> batch;
  batch.reserve(64);
  auto start = Clock::now();
  for (int done = 0; done < total;) {
    int k = std::min(64, total - done);
    for (int i = 0; i < k; ++i) {
      batch.push_back(rt.remote<at::Tensor>("worker1", "add_one", x));
    }
    for (const auto& rref : batch) {
      // Like PyTorch's rref._get_future().wait(): the owner has run add_one
      // and answered the creation.
      rref.confirmedAsync().wait();
    }
    batch.clear(); // each user fork sends its deletion
    done += k;
  }
  *polls = waitRRefsGone(rt);
  return std::chrono::duration<double>(Clock::now() - start).count();
}

double rrefsPerSecond(Runtime& rt, bool quick) {
  int polls = 0;
  rrefChurn(rt, quick ? 128 : 640, &polls);
  int total = quick ? 1280 : 6400;
  double seconds = rrefChurn(rt, total, &polls);
  std::cerr << total << " RRefs created+deleted in " << seconds << " s ("
            << polls << " polls at end)\n";
  return total / seconds;
}

// ---- dist_autograd_overhead -------------------------------------------------

// The model and its optimizer on worker1: forward, and an SGD step with the
// gradients a distributed backward left in the calling request's context
// (what a DistributedOptimizer does on each parameter owner).
void registerModel(Runtime& rt) {
  auto model = makeSplitTrainingModel();
  auto sgd = std::make_shared<torch::optim::SGD>(
      model->parameters(),
      torch::optim::SGDOptions(kSplitTrainingLearningRate));
  rt.functions().add("model_forward", [model](at::Tensor x) mutable {
    return model->forward(x);
  });
  rt.functions().add("sgd_step", [&rt, model, sgd]() {
    auto contextId = rt.autogradContexts().currentContextId();
    auto grads = torchrpc::autograd::getGradients(rt, contextId);
    auto params = model->parameters();
    for (auto& p : params) {
      p.mutable_grad() = grads.at(p);
    }
    sgd->step();
    for (auto& p : params) {
      p.mutable_grad() = at::Tensor();
    }
    return true;
  });
}

// The workload's loop is medianSplitTrainingOverhead's
// (bench/split_training.h); worker1 idles, without spinning, during the
// local iterations.
double distAutogradOverhead(Runtime& rt, bool quick) {
  LocalTraining local;
  const at::Tensor& x = local.input();
  // Each iteration's phases, for stderr: where a difference comes from.
  Phases phases;
  auto localIteration = [&]() {
    phases.start();
    local.iterate([&phases](const char* name) { phases.end(name); });
  };
  auto distributedIteration = [&]() {
    phases.start();
    {
      torchrpc::autograd::Context context(rt);
      auto out = rt.rpcSync<at::Tensor>("worker1", "model_forward", x);
      phases.end("forward call");
      context.backward({out.sum()});
      phases.end("distributed backward");
      rt.rpcSync<bool>("worker1", "sgd_step");
      phases.end("step call");
    }
    phases.end("context release");
  };
  const double overhead = medianSplitTrainingOverhead(
      localIteration,
      distributedIteration,
      quick,
      [&phases]() { phases.clear(); });
  phases.print(std::cerr);
  return overhead;
}

// ---- dist_optimizer_step ---------------------------------------------------

const std::vector<std::string> kOptimOwners = {"worker1", "worker2"};
constexpr int kOptimParamsPerOwner = 50;
constexpr int64_t kOptimParamNumel = 1024;

// On each owner: make_param creates one parameter there and keeps its owner
// RRef; sum_params, the forward, sums every parameter the worker owns. It
// reads each through localValue() at every call: a step publishes each
// parameter as a new tensor.
void registerParameters(Runtime& rt) {
  struct Owned {
    std::mutex mutex;
    std::vector<RRef<at::Tensor>> parameters;
  };
  auto owned = std::make_shared<Owned>();
  rt.functions().add("make_param", [&rt, owned]() {
    auto parameter =
        rt.makeRRef(at::randn({kOptimParamNumel}).requires_grad_());
    std::lock_guard<std::mutex> guard(owned->mutex);
    owned->parameters.push_back(parameter);
    return parameter;
  });
  rt.functions().add("sum_params", [owned]() {
    std::vector<at::Tensor> values;
    {
      std::lock_guard<std::mutex> guard(owned->mutex);
      for (const auto& parameter : owned->parameters) {
        values.push_back(parameter.localValue());
      }
    }
    return at::stack(values).sum();
  });
}

// Adam over 2 owners x 50 parameters: each iteration runs a forward (one
// call per owner) and a backward in a fresh context; only opt.step() is
// timed.
double distOptimizerStep(Runtime& rt, bool quick) {
  std::vector<RRef<at::Tensor>> parameters;
  for (const auto& owner : kOptimOwners) {
    for (int i = 0; i < kOptimParamsPerOwner; ++i) {
      parameters.push_back(rt.rpcSync<RRef<at::Tensor>>(owner, "make_param"));
    }
  }
  torchrpc::optim::DistributedOptimizer opt(
      rt,
      parameters,
      torch::optim::AdamOptions(1e-3));
  auto iteration = [&]() {
    torchrpc::autograd::Context context(rt);
    auto loss = rt.rpcSync<at::Tensor>(kOptimOwners[0], "sum_params");
    for (size_t i = 1; i < kOptimOwners.size(); ++i) {
      loss = loss + rt.rpcSync<at::Tensor>(kOptimOwners[i], "sum_params");
    }
    context.backward({loss});
    auto start = Clock::now();
    opt.step(context.id());
    return microsSince(start);
  };
  int warmup = quick ? 5 : 20;
  int timed = quick ? 100 : 500;
  // Fewer steps once the timed iterations took this long.
  auto limit = std::chrono::seconds(quick ? 8 : 30);
  for (int i = 0; i < warmup; ++i) {
    iteration();
  }
  std::vector<double> times;
  times.reserve(timed);
  auto end = Clock::now() + limit;
  while (static_cast<int>(times.size()) < timed &&
         (times.empty() || Clock::now() < end)) {
    times.push_back(iteration());
  }
  printDistribution("step", times);
  auto counts = opt.stepCounts();
  std::cerr << "steps applied: " << counts.at(0) << " on " << kOptimOwners[0]
            << ", " << counts.at(1) << " on " << kOptimOwners[1] << "\n";
  return median(times);
}

// ---- ps_steps_per_s_vs_local -----------------------------------------------

// worker0 is the parameter server (and the driver), worker1 and worker2 the
// trainers. The model, an MLP 784-256-10, lives on worker0 as a
// RemoteModule; each trainer trains it with its own DistributedOptimizer.
using PsModule =
    torchrpc::nn::RemoteModule<torch::nn::Sequential, at::Tensor(at::Tensor)>;
constexpr const char* kPsModelType = "bench.ps_mlp";
constexpr int64_t kPsBatch = 64;

torch::nn::Sequential makePsModel() {
  torch::manual_seed(0);
  return torch::nn::Sequential(
      torch::nn::Linear(784, 256),
      torch::nn::ReLU(),
      torch::nn::Linear(256, 10));
}

// One fixed batch, generated once: the loop's speed is the point.
std::pair<at::Tensor, at::Tensor> psBatch(int64_t seed) {
  torch::manual_seed(seed);
  return {at::randn({kPsBatch, 784}), at::randint(0, 10, {kPsBatch})};
}

// Warm-up steps, then steps until maxSteps or the window has elapsed (at
// least one). Returns {steps, seconds} of the timed part.
struct PsBounds {
  int warmup;
  int maxSteps;
  double windowSeconds;
};

PsBounds psBounds(bool quick) {
  return quick ? PsBounds{5, 2000, 3.0} : PsBounds{20, 20000, 10.0};
}

std::pair<int64_t, double> timedSteps(
    const PsBounds& bounds,
    const std::function<void()>& step) {
  for (int i = 0; i < bounds.warmup; ++i) {
    step();
  }
  auto start = Clock::now();
  auto end = start +
      std::chrono::duration_cast<Clock::duration>(
                 std::chrono::duration<double>(bounds.windowSeconds));
  int64_t steps = 0;
  while (steps < bounds.maxSteps && (steps == 0 || Clock::now() < end)) {
    step();
    ++steps;
  }
  return {steps, std::chrono::duration<double>(Clock::now() - start).count()};
}

struct PsState {
  std::mutex mutex;
  std::condition_variable changed;
  std::optional<PsModule> model;
  std::vector<std::pair<int64_t, double>> reports; // {steps, seconds}
};

// On worker0: the model's factory, "ps_model" (blocks until the driver has
// created the model, after its local measurement) and "ps_report" (a
// trainer's timed steps).
void registerParameterServer(Runtime& rt, std::shared_ptr<PsState> state) {
  torchrpc::nn::registerModuleFactory<
      torch::nn::Sequential,
      at::Tensor(at::Tensor)>(rt, kPsModelType, []() { return makePsModel(); });
  rt.functions().add("ps_model", [state]() {
    std::unique_lock<std::mutex> lock(state->mutex);
    if (!state->changed.wait_for(lock, std::chrono::seconds(120), [&] {
          return state->model.has_value();
        })) {
      throw std::runtime_error("the parameter server's model never appeared");
    }
    return *state->model;
  });
  rt.functions().add("ps_report", [state](int64_t steps, double seconds) {
    std::lock_guard<std::mutex> guard(state->mutex);
    state->reports.emplace_back(steps, seconds);
    state->changed.notify_all();
    return true;
  });
}

// On a trainer, after start(): the loop of the parameter-server example.
void psTrainer(Runtime& rt, int rank, bool quick) {
  auto model = rt.rpcSync<PsModule>("worker0", "ps_model");
  torchrpc::optim::DistributedOptimizer opt(
      rt,
      model.remoteParameters(),
      torch::optim::SGDOptions(0.01));
  auto [x, y] = psBatch(rank);
  auto result = timedSteps(psBounds(quick), [&]() {
    torchrpc::autograd::Context context(rt);
    auto logits = model.forward(x);
    auto loss = torch::nn::functional::cross_entropy(logits, y);
    context.backward({loss});
    opt.step(context.id());
  });
  std::cerr << "worker" << rank << ": " << result.first << " steps in "
            << result.second << " s\n";
  rt.rpcSync<bool>("worker0", "ps_report", result.first, result.second);
}

// Local steps/s (plain libtorch, in this process, before the trainers
// start), then the trainers' aggregate steps/s; returns their ratio.
double psStepsVsLocal(Runtime& rt, PsState& state, bool quick) {
  auto bounds = psBounds(quick);
  auto local = makePsModel();
  torch::optim::SGD sgd(local->parameters(), torch::optim::SGDOptions(0.01));
  auto [x, y] = psBatch(0);
  auto localResult = timedSteps(bounds, [&]() {
    sgd.zero_grad();
    torch::nn::functional::cross_entropy(local->forward(x), y).backward();
    sgd.step();
  });
  double localRate = localResult.first / localResult.second;
  std::cerr << "local: " << localResult.first << " steps in "
            << localResult.second << " s = " << localRate << " steps/s\n";

  auto model = PsModule::withTypeName(rt, "worker0", kPsModelType);
  std::unique_lock<std::mutex> lock(state.mutex);
  state.model = model;
  state.changed.notify_all();
  double limit = bounds.windowSeconds * 4 + 60;
  if (!state.changed.wait_for(lock, std::chrono::duration<double>(limit), [&] {
        return state.reports.size() == 2;
      })) {
    throw std::runtime_error("the trainers did not report");
  }
  double aggregate = 0;
  for (const auto& report : state.reports) {
    aggregate += report.first / report.second;
  }
  std::cerr << "parameter server: aggregate " << aggregate
            << " steps/s over 2 trainers; local " << localRate << " steps/s\n";
  return aggregate / localRate;
}

int runWorker(
    int rank,
    const Settings& s,
    const std::string& store,
    int resultFd,
    int goFd) {
  Runtime rt("worker" + std::to_string(rank), workerOptions(rank, s, store));
  // Both never block and take microseconds: registered cheap, they run
  // where the call arrives (FunctionOptions), as a user would register them.
  torchrpc::rpc::FunctionOptions cheap;
  cheap.cheap = true;
  rt.functions().add(
      "add_one",
      [](at::Tensor x) { return x + 1; },
      cheap);
  rt.functions().add(
      "sink",
      [](at::Tensor) { return at::zeros({1}); },
      cheap);
  // rref_create_delete_per_s: RRefs worker1 owns (and forks still use).
  rt.functions().add("owner_rref_count", [&rt]() {
    return static_cast<int64_t>(rt.rrefs().counters().ownerRRefs);
  });
  if (s.workload == "dist_autograd_overhead" && rank == 1) {
    registerModel(rt);
  }
  if (s.workload == "dist_optimizer_step" && rank > 0) {
    registerParameters(rt);
  }
  auto ps = std::make_shared<PsState>();
  bool psWorkload = s.workload == "ps_steps_per_s_vs_local";
  if (psWorkload && rank == 0) {
    registerParameterServer(rt, ps);
  }
  rt.start();
  if (psWorkload && rank > 0) {
    psTrainer(rt, rank, s.quick);
  }
  if (s.workload == "idle_cpu_cores") {
    if (rank == 0) {
      rt.rpcSync<at::Tensor>("worker1", "add_one", at::ones({1}));
    }
    char ready = 1;
    writeAll(resultFd, &ready, 1);
    readWithin(goFd, 1, 120000); // blocks without using CPU
  } else if (rank == 0) {
    double value = 0;
    if (s.workload == "call_rtt_1elem") {
      value = callRtt(rt, s.quick);
    } else if (s.workload == "calls_per_s_64_outstanding") {
      value = callsPerSecond(rt, s.quick);
    } else if (s.workload == "bandwidth_4MiB") {
      value = bandwidth(rt, size_t(4) << 20, s.quick);
    } else if (s.workload == "bandwidth_64MiB") {
      value = bandwidth(rt, size_t(64) << 20, s.quick);
    } else if (s.workload == "remote_to_here_rtt") {
      value = remoteToHereRtt(rt, s.quick);
    } else if (s.workload == "rref_create_delete_per_s") {
      value = rrefsPerSecond(rt, s.quick);
    } else if (s.workload == "dist_autograd_overhead") {
      value = distAutogradOverhead(rt, s.quick);
    } else if (s.workload == "dist_optimizer_step") {
      value = distOptimizerStep(rt, s.quick);
    } else if (psWorkload) {
      value = psStepsVsLocal(rt, *ps, s.quick);
    }
    writeAll(resultFd, &value, sizeof(value));
  }
  return rt.shutdown() ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
  Settings s = parseCommandLine(kProgram, argc, argv);
  // Checked here, not only in the workers: a worker's usage error would
  // leave this process waiting out the whole result timeout.
  if (s.transport != "tcp" && s.transport != "tensorpipe" &&
      s.transport != "tensorpipe-shm") {
    usage(kProgram, "unknown transport '" + s.transport + "'");
  }

  std::string store = "/tmp/torchrpc_bench_" + std::to_string(::getpid());
  std::remove(store.c_str());
  int results[2];
  int go[2];
  if (::pipe(results) != 0 || ::pipe(go) != 0) {
    std::perror("pipe");
    return 1;
  }
  double value = 0;
  bool ok = true;
  {
    WorkerProcesses workers;
    std::vector<pid_t> pids;
    for (int rank = 0; rank < worldSize(s.workload); ++rank) {
      pids.push_back(workers.fork([&s, &store, &results, &go, rank]() {
        try {
          return runWorker(rank, s, store, results[1], go[0]);
        } catch (const std::exception& e) {
          std::cerr << "worker" << rank << ": " << e.what() << "\n";
          return 1;
        }
      }));
    }
    int limitMs = resultTimeoutMs(s);
    if (s.workload == "idle_cpu_cores") {
      char ready[2];
      ok = readExactlyWithin(results[0], &ready[0], 1, limitMs) &&
          readExactlyWithin(results[0], &ready[1], 1, limitMs);
      if (ok) {
        value = measureIdleCpu({pids[0], pids[1]}, s.quick).cores;
      }
      char release[2] = {1, 1};
      writeAll(go[1], release, 2);
    } else {
      ok = readExactlyWithin(results[0], &value, sizeof(value), limitMs);
    }
    if (!ok) {
      std::cerr << "torchrpc_bench: workers did not deliver a result\n";
    } else {
      // As long as their shutdownTimeout allows a graceful shutdown.
      workers.awaitExit(60000);
    }
  } // kills and reaps whatever is left
  std::remove(store.c_str());
  if (!ok) {
    return 1;
  }
  printResultLine(s, value, {{"transport", s.transport}});
  return 0;
}
