#pragma once

#include <cstdint>

#include "torchrpc/optim/distributed_optimizer.h"

namespace torchrpc {
namespace optim {

// Learning-rate schedules that drive a DistributedOptimizer's learning rate
// on every owner, with PyTorch's rules: call step() once per epoch (or
// whatever unit the schedule counts), after the optimizer's steps of that
// epoch; after n calls the rate is the schedule's rate for epoch n. The base
// rate is the optimizer's rate when the scheduler is made.
//
// libtorch's C++ torch::optim::StepLR lags PyTorch's by one call (its first
// decay comes at call stepSize + 1); these follow PyTorch's.
class LRScheduler {
 public:
  explicit LRScheduler(DistributedOptimizer& optimizer);
  virtual ~LRScheduler() = default;

  // Advances one epoch and sets the new rate on every owner if it changed.
  void step();
  // Epochs stepped so far.
  int64_t epoch() const {
    return epoch_;
  }
  double baseLearningRate() const {
    return base_;
  }

 protected:
  // The rate for `epoch` (>= 1).
  virtual double rateAt(int64_t epoch) const = 0;

 private:
  DistributedOptimizer& optimizer_;
  const double base_;
  int64_t epoch_ = 0;
};

// lr = base * gamma ^ floor(epoch / stepSize), as PyTorch's StepLR.
class StepLR : public LRScheduler {
 public:
  StepLR(DistributedOptimizer& optimizer, int64_t stepSize, double gamma = 0.1);

 protected:
  double rateAt(int64_t epoch) const override;

 private:
  const int64_t stepSize_;
  const double gamma_;
};

// lr = base * gamma ^ epoch, as PyTorch's ExponentialLR.
class ExponentialLR : public LRScheduler {
 public:
  ExponentialLR(DistributedOptimizer& optimizer, double gamma);

 protected:
  double rateAt(int64_t epoch) const override;

 private:
  const double gamma_;
};

} // namespace optim
} // namespace torchrpc
