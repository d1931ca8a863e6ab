#include "torchrpc/optim/lr_scheduler.h"

#include <c10/util/Exception.h>

#include <cmath>

namespace torchrpc {
namespace optim {

LRScheduler::LRScheduler(DistributedOptimizer& optimizer)
    : optimizer_(optimizer),
      base_(optimizer.learningRate()) {}

void LRScheduler::step() {
  ++epoch_;
  double rate = rateAt(epoch_);
  if (rate != optimizer_.learningRate()) {
    optimizer_.setLearningRate(rate);
  }
}

StepLR::StepLR(DistributedOptimizer& optimizer, int64_t stepSize, double gamma)
    : LRScheduler(optimizer),
      stepSize_(stepSize),
      gamma_(gamma) {
  TORCH_CHECK(stepSize > 0, "StepLR needs stepSize > 0, got ", stepSize);
  TORCH_CHECK(gamma > 0, "StepLR needs gamma > 0, got ", gamma);
}

double StepLR::rateAt(int64_t epoch) const {
  return baseLearningRate() *
      std::pow(gamma_, static_cast<double>(epoch / stepSize_));
}

ExponentialLR::ExponentialLR(DistributedOptimizer& optimizer, double gamma)
    : LRScheduler(optimizer),
      gamma_(gamma) {
  TORCH_CHECK(gamma > 0, "ExponentialLR needs gamma > 0, got ", gamma);
}

double ExponentialLR::rateAt(int64_t epoch) const {
  return baseLearningRate() * std::pow(gamma_, static_cast<double>(epoch));
}

} // namespace optim
} // namespace torchrpc
