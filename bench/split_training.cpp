#include "bench/split_training.h"

#include <algorithm>
#include <iostream>
#include <vector>

#include "bench/bench_support.h"

namespace torchrpc {
namespace bench {

torch::nn::Sequential makeSplitTrainingModel() {
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int i = 0; i < 4; ++i) {
    model->push_back(torch::nn::Linear(1024, 1024));
  }
  return model;
}

LocalTraining::LocalTraining()
    : model_(makeSplitTrainingModel()),
      sgd_(
          model_->parameters(),
          torch::optim::SGDOptions(kSplitTrainingLearningRate)),
      x_(at::rand({1, 1024})) {}

void LocalTraining::iterate(const std::function<void(const char*)>& phase) {
  for (auto& p : model_->parameters()) {
    p.mutable_grad() = at::Tensor(); // zero_grad(set_to_none=True)
  }
  at::Tensor output = model_->forward(x_);
  lastOutput_ = output.detach();
  auto loss = output.sum();
  if (phase) {
    phase("local forward");
  }
  loss.backward();
  if (phase) {
    phase("local backward");
  }
  sgd_.step();
  if (phase) {
    phase("local step");
  }
}

double medianSplitTrainingOverhead(
    const std::function<void()>& localIteration,
    const std::function<void()>& distributedIteration,
    bool quick,
    const std::function<void()>& afterWarmUp) {
  const int warmUp = quick ? 5 : 20;
  const int timed = quick ? 40 : 200;
  for (int i = 0; i < warmUp; ++i) {
    localIteration();
    distributedIteration();
  }
  if (afterWarmUp) {
    afterWarmUp();
  }
  std::vector<double> local;
  std::vector<double> distributed;
  std::vector<double> differences;
  for (int i = 0; i < timed; ++i) {
    auto start = Clock::now();
    localIteration();
    local.push_back(microsSince(start));
    start = Clock::now();
    distributedIteration();
    distributed.push_back(microsSince(start));
    differences.push_back(distributed.back() - local.back());
  }
  const double l = median(local);
  const double d = median(distributed);
  std::cerr << "local iteration: median " << l << " us, min "
            << *std::min_element(local.begin(), local.end())
            << " us; distributed: median " << d << " us, min "
            << *std::min_element(distributed.begin(), distributed.end())
            << " us; difference of medians " << d - l << " us\n";
  return median(differences);
}

} // namespace bench
} // namespace torchrpc
