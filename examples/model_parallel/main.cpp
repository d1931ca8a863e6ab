// Model parallelism with a pipeline: an MLP 784-256-10 split into two stages,
// each a RemoteModule on its own worker (stage 1, Linear 784->256 + ReLU, on
// worker1; stage 2, Linear 256->10, on worker2), driven by worker0. Each
// batch is cut into micro-batches that are all in flight at once: a
// micro-batch's stage-2 call starts when its stage-1 output arrives, so
// stage 2 works on one micro-batch while stage 1 works on the next. Trained
// with distributed autograd and a DistributedOptimizer over both stages.
//
//   model_parallel                starts the three workers itself
//   torchrun --nproc-per-node 3 model_parallel ...   one worker per process
//
// It trains --steps steps without pipelining (one micro-batch), then
// --steps steps with --micro-batches, and prints the throughput of each.

#include <torchrpc/torchrpc.h>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/nn/functional/loss.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <vector>

// The parameter-server example's loader and local launcher.
#include "fashion_mnist.h"
#include "local_launch.h"

namespace {

using Stage =
    torchrpc::nn::RemoteModule<torch::nn::Sequential, at::Tensor(at::Tensor)>;

constexpr const char* kStage1 = "mp.stage1";
constexpr const char* kStage2 = "mp.stage2";

struct Config {
  int64_t steps = 60;
  int64_t batchSize = 128;
  int64_t microBatches = 4;
  double lr = 0.05;
  int64_t logEvery = 10;
  int64_t seed = 1;
  std::string dataDir = "/usr/share/datasets/fashion-mnist";
  std::string cacheDir; // empty: <temp dir>/torchrpc-fashion-mnist
};

bool startedByLauncher() {
  return torchrpc::rpc::LaunchEnvironment::fromEnvironment().launcher !=
      torchrpc::rpc::Launcher::kNone;
}

// On every worker: the two stages, creatable by name.
void registerStages(torchrpc::rpc::Runtime& rt) {
  torchrpc::nn::registerModuleFactory<
      torch::nn::Sequential,
      at::Tensor(at::Tensor)>(rt, kStage1, [](int64_t seed) {
    torch::manual_seed(seed);
    return torch::nn::Sequential(
        torch::nn::Linear(784, 256),
        torch::nn::ReLU());
  });
  torchrpc::nn::registerModuleFactory<
      torch::nn::Sequential,
      at::Tensor(at::Tensor)>(rt, kStage2, [](int64_t seed) {
    torch::manual_seed(seed + 1);
    return torch::nn::Sequential(torch::nn::Linear(256, 10));
  });
}

// The logits of `images`, cut into `parts` micro-batches: every stage-1
// call is sent at once, then, in order, each micro-batch's stage-2 call is
// sent as soon as its stage-1 output has arrived, so stage 2 works on one
// micro-batch while stage 1 still works on the next ones; then all are
// waited for and concatenated in order.
//
// NB: stage 2 is called from this thread, not from a continuation chained
// with Future::then on stage 1's future: such a continuation runs on an
// agent thread, where the autograd::Context guard of this thread is not
// current (only continuations of a handler carry its request's context), so
// its call would record nothing and the backward pass would not reach the
// stages.
at::Tensor pipelinedForward(
    const Stage& stage1,
    const Stage& stage2,
    const at::Tensor& images,
    int64_t parts) {
  std::vector<torchrpc::Future<at::Tensor>> hidden;
  for (const at::Tensor& micro : images.chunk(parts, 0)) {
    hidden.push_back(stage1.forwardAsync(micro));
  }
  std::vector<torchrpc::Future<at::Tensor>> outputs;
  outputs.reserve(hidden.size());
  for (const auto& h : hidden) {
    outputs.push_back(stage2.forwardAsync(h.wait()));
  }
  std::vector<at::Tensor> logits;
  logits.reserve(outputs.size());
  for (const auto& output : outputs) {
    logits.push_back(output.wait());
  }
  return at::cat(logits, 0);
}

int drive(torchrpc::Runtime& rt, const Config& config) {
  ps::Examples data = ps::loadFashionMnist(config.cacheDir, /*train=*/true);
  Stage stage1 = Stage::withTypeName(rt, "worker1", kStage1, config.seed);
  Stage stage2 = Stage::withTypeName(rt, "worker2", kStage2, config.seed);
  auto params = stage1.remoteParameters();
  for (auto& p : stage2.remoteParameters()) {
    params.push_back(p);
  }
  torchrpc::optim::DistributedOptimizer optimizer(
      rt,
      params,
      torch::optim::SGDOptions(config.lr).momentum(0.9));

  auto generator = at::detail::createCPUGenerator(uint64_t(config.seed));
  at::Tensor order =
      at::randperm(data.size(), generator, at::TensorOptions(at::kLong));
  const int64_t perEpoch = data.size() / config.batchSize;
  int64_t step = 0;
  double windowLoss = 0;
  int64_t windowSteps = 0;

  // --steps steps with `parts` micro-batches; returns samples per second.
  auto run = [&](int64_t parts) {
    int64_t samples = 0;
    auto start = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < config.steps; ++i, ++step) {
      int64_t b = step % perEpoch;
      at::Tensor rows =
          order.slice(0, b * config.batchSize, (b + 1) * config.batchSize);
      at::Tensor images = data.images.index_select(0, rows);
      at::Tensor labels = data.labels.index_select(0, rows);
      double loss = 0;
      {
        torchrpc::autograd::Context context(rt);
        at::Tensor logits = pipelinedForward(stage1, stage2, images, parts);
        at::Tensor lossTensor =
            torch::nn::functional::cross_entropy(logits, labels);
        context.backward({lossTensor});
        optimizer.step(context.id());
        loss = lossTensor.item<double>();
      }
      samples += images.size(0);
      windowLoss += loss;
      ++windowSteps;
      if ((step + 1) % config.logEvery == 0) {
        std::printf(
            "step %lld micro-batches %lld loss %.4f\n",
            (long long)(step + 1),
            (long long)parts,
            windowLoss / windowSteps);
        std::fflush(stdout);
        windowLoss = 0;
        windowSteps = 0;
      }
    }
    std::chrono::duration<double> took =
        std::chrono::steady_clock::now() - start;
    return samples / took.count();
  };

  double plain = run(1);
  double piped = run(config.microBatches);
  std::printf(
      "throughput micro-batches 1: %.0f samples/s (%lld steps)\n",
      plain,
      (long long)config.steps);
  std::printf(
      "throughput micro-batches %lld: %.0f samples/s (%lld steps)\n",
      (long long)config.microBatches,
      piped,
      (long long)config.steps);
  std::fflush(stdout);
  return 0;
}

int runWorker(const Config& config) {
  at::set_num_threads(1);
  auto options = torchrpc::Options::fromEnvironment();
  TORCH_CHECK(
      options.worldSize == 3,
      "WORLD_SIZE is ",
      options.worldSize,
      ": model_parallel runs a driver and two stages, 3 workers");
  torchrpc::Runtime rt("worker" + std::to_string(options.rank), options);
  registerStages(rt);
  rt.start();
  int code = 0;
  if (options.rank == 0) {
    try {
      code = drive(rt, config);
    } catch (const c10::Error& e) {
      std::cerr << "worker0: " << e.what_without_backtrace() << std::endl;
      code = 1;
    } catch (const std::exception& e) {
      std::cerr << "worker0: " << e.what() << std::endl;
      code = 1;
    }
  }
  // Graceful: the stages serve until the driver shuts down too.
  bool clean = rt.shutdown();
  return code != 0 ? code : (clean ? 0 : 1);
}

} // namespace

int main(int argc, char** argv) {
  Config config;
  CLI::App app(
      "Trains an MLP (784-256-10) on Fashion-MNIST split into two pipelined "
      "stages on two workers (torchrpc: RemoteModule::forwardAsync, "
      "distributed autograd, DistributedOptimizer), and compares the "
      "throughput without and with micro-batches.",
      "model_parallel");
  app.option_defaults()->always_capture_default();
  app.add_option(
         "--steps",
         config.steps,
         "steps of each phase (1 micro-batch, then --micro-batches)")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch-size", config.batchSize, "examples per step")
      ->check(CLI::PositiveNumber);
  app.add_option(
         "--micro-batches",
         config.microBatches,
         "micro-batches per batch in the pipelined phase")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", config.lr, "SGD's learning rate (momentum 0.9)")
      ->check(CLI::PositiveNumber);
  app.add_option("--log-every", config.logEvery, "steps between loss lines")
      ->check(CLI::PositiveNumber);
  app.add_option(
      "--data-dir",
      config.dataDir,
      "Fashion-MNIST's four .gz files (Debian: dataset-fashion-mnist)");
  app.add_option(
      "--cache-dir",
      config.cacheDir,
      "where they are unpacked (default: <temp dir>/torchrpc-fashion-mnist)");
  CLI11_PARSE(app, argc, argv);
  if (config.microBatches > config.batchSize) {
    std::cerr << "model_parallel: --micro-batches exceeds --batch-size"
              << std::endl;
    return 2;
  }

  if (config.cacheDir.empty()) {
    config.cacheDir =
        (std::filesystem::temp_directory_path() / "torchrpc-fashion-mnist")
            .string();
  }
  try {
    config.cacheDir = ps::unpackFashionMnist(config.dataDir, config.cacheDir);
  } catch (const c10::Error& e) {
    std::cerr << "model_parallel: " << e.what_without_backtrace() << std::endl;
    return 2;
  }
  if (!startedByLauncher()) {
    return ps::launchLocally(3, [&config]() { return runWorker(config); });
  }
  try {
    return runWorker(config);
  } catch (const std::exception& e) {
    std::cerr << "model_parallel: " << e.what() << std::endl;
    return 1;
  }
}
