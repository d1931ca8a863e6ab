#include "trainer.h"

#include <torch/nn/functional/loss.h>
#include <torchrpc/torchrpc.h>

#include <chrono>
#include <iostream>
#include <optional>
#include <thread>

#include "checkpoint.h"
#include "fashion_mnist.h"
#include "model.h"
#include "progress.h"

namespace ps {
namespace {

using MlpModule = torchrpc::nn::RemoteModule<Mlp>;

// Steps between two reports of the curves to the server.
constexpr int64_t kReportEvery = 10;

torchrpc::optim::OptimizerOptions optimizerOptions(const Config& config) {
  if (config.optimizer == "adam") {
    return torch::optim::AdamOptions(config.lr);
  }
  TORCH_CHECK(
      config.optimizer == "sgd",
      "--optimizer must be sgd or adam, not '",
      config.optimizer,
      "'");
  return torch::optim::SGDOptions(config.lr).momentum(config.momentum);
}

// Polls `done` until it holds; the server answers every poll at once, so
// no pool thread of it ever waits for a trainer.
template <typename F>
void pollUntil(F done, std::chrono::seconds bound, const char* what) {
  auto deadline = std::chrono::steady_clock::now() + bound;
  while (!done()) {
    TORCH_CHECK(
        std::chrono::steady_clock::now() < deadline,
        "waited ",
        bound.count(),
        " s for ",
        what);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

int train(torchrpc::Runtime& rt, const Config& config, int trainer) {
  const std::string who = "trainer" + std::to_string(trainer);
  Examples data = shard(
      loadFashionMnist(config.cacheDir, /*train=*/true),
      trainer - 1,
      config.trainers);
  pollUntil(
      [&rt]() { return rt.rpcSync<bool>("worker0", "ps.ready"); },
      std::chrono::seconds(300),
      "the server's model");
  auto model = rt.rpcSync<MlpModule>("worker0", "ps.model");
  const int64_t firstStep = rt.rpcSync<int64_t>("worker0", "ps.start_step");
  const std::string dir =
      rt.rpcSync<std::string>("worker0", "ps.checkpoint_dir");

  torchrpc::optim::DistributedOptimizer optimizer(
      rt,
      model.remoteParameters(),
      optimizerOptions(config));
  if (firstStep > 0) {
    optimizer.loadOnOwners(optimizerPrefix(dir, firstStep, trainer));
  }

  const int64_t n = data.size();
  const int64_t stepsPerEpoch = (n + config.batchSize - 1) / config.batchSize;
  int64_t lastStep = config.epochs * stepsPerEpoch;
  if (config.maxSteps > 0) {
    lastStep = std::min(lastStep, config.maxSteps);
  }
  Progress progress(
      who,
      stepsPerEpoch,
      firstStep,
      lastStep,
      config.progressSeconds);
  Window report;
  std::optional<torchrpc::Future<void>> reported;
  at::Tensor order;
  for (int64_t step = firstStep; step < lastStep; ++step) {
    const int64_t epoch = step / stepsPerEpoch;
    const int64_t batch = step % stepsPerEpoch;
    if (!order.defined() || batch == 0) {
      // The same order for a step whether the run was resumed or not.
      auto generator = at::detail::createCPUGenerator(
          uint64_t(config.seed) * 1000003 + uint64_t(epoch) * 1009 + trainer);
      order = at::randperm(n, generator, at::TensorOptions(at::kLong));
    }
    at::Tensor rows = order.slice(
        0,
        batch * config.batchSize,
        std::min(n, (batch + 1) * config.batchSize));
    at::Tensor images = data.images.index_select(0, rows);
    at::Tensor labels = data.labels.index_select(0, rows);

    double loss = 0;
    int64_t correct = 0;
    {
      torchrpc::autograd::Context context(rt);
      at::Tensor logits = model.forward(images);
      at::Tensor lossTensor =
          torch::nn::functional::cross_entropy(logits, labels);
      context.backward({lossTensor});
      optimizer.step(context.id());
      loss = lossTensor.item<double>();
      correct = logits.argmax(1).eq(labels).sum().item<int64_t>();
    }
    progress.add(step, loss, correct, rows.size(0));
    report.add(loss, correct, rows.size(0));

    const int64_t taken = step + 1;
    if (taken % kReportEvery == 0 || taken == lastStep) {
      if (reported) {
        reported->wait();
      }
      reported = rt.rpcAsync<void>(
          "worker0",
          "ps.report",
          int64_t(trainer),
          taken,
          report.meanLoss(),
          report.accuracy());
      report = Window();
    }
    if (auto line = progress.lineIfDue()) {
      std::cout << *line << std::endl;
    }
    if (taken % stepsPerEpoch == 0 || taken == lastStep) {
      // See Note [Checkpoints] in checkpoint.h: the optimizer first, then the
      // server saves the model once every trainer waits here.
      optimizer.saveOnOwners(optimizerPrefix(dir, taken, trainer));
      rt.rpcSync<void>("worker0", "ps.checkpoint", int64_t(trainer), taken);
      pollUntil(
          [&rt, taken]() {
            return rt.rpcSync<int64_t>("worker0", "ps.checkpointed") >= taken;
          },
          std::chrono::seconds(600),
          "the other trainers to reach the checkpoint");
    }
  }
  if (reported) {
    reported->wait();
  }
  if (firstStep < lastStep) {
    std::cout << progress.line() << std::endl;
  }
  std::cout << who << ": done, " << lastStep - firstStep << " steps in this run"
            << std::endl;
  rt.rpcSync<void>("worker0", "ps.done", int64_t(trainer));
  return 0;
}

} // namespace

int runTrainer(torchrpc::Runtime& rt, const Config& config, int trainer) {
  try {
    return train(rt, config, trainer);
  } catch (const std::exception& e) {
    // libtorch's errors carry a backtrace that says nothing to a user.
    const auto* error = dynamic_cast<const c10::Error*>(&e);
    std::string what = error ? error->what_without_backtrace() : e.what();
    std::cerr << "trainer" << trainer << ": " << what << std::endl;
    try {
      rt.rpcSync<void>("worker0", "ps.failed", int64_t(trainer), what);
    } catch (const std::exception&) {
      // The server is gone too; the exit code tells.
    }
    return 1;
  }
}

} // namespace ps
