#pragma once

#include <ATen/core/Dict.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <memory>
#include <string>
#include <vector>

namespace torchrpc {
namespace optim {

// Which libtorch optimizer the owners of a DistributedOptimizer run, with
// its options, as plain data that travels over the wire (no pickling, no
// code). Built implicitly from libtorch's own option types:
//
//   DistributedOptimizer opt(rt, params, torch::optim::AdamOptions(1e-3));
//
// SGD, Adam, AdamW, Adagrad and RMSprop. LBFGS is refused (c10::Error): its
// step re-evaluates the loss through a closure several times per step, and a
// distributed step has no loss to re-evaluate on the owners.
class OptimizerOptions {
 public:
  OptimizerOptions(const torch::optim::SGDOptions& options);
  OptimizerOptions(const torch::optim::AdamOptions& options);
  OptimizerOptions(const torch::optim::AdamWOptions& options);
  OptimizerOptions(const torch::optim::AdagradOptions& options);
  OptimizerOptions(const torch::optim::RMSpropOptions& options);
  OptimizerOptions(const torch::optim::LBFGSOptions& options);

  // "SGD", "Adam", "AdamW", "Adagrad" or "RMSprop".
  const std::string& kind() const {
    return kind_;
  }
  double learningRate() const;

  // The wire form: the kind and every option by libtorch's name ("lr",
  // "betas.0", "nesterov" as 0/1...).
  const c10::Dict<std::string, double>& values() const {
    return values_;
  }
  // Checks the wire form: a known kind, known names, every option present,
  // values libtorch accepts. Throws c10::Error naming what is wrong.
  static OptimizerOptions fromWire(
      const std::string& kind,
      const c10::Dict<std::string, double>& values);

  // A libtorch optimizer of this kind over `parameters`.
  std::unique_ptr<torch::optim::Optimizer> make(
      std::vector<at::Tensor> parameters) const;

 private:
  OptimizerOptions(std::string kind, c10::Dict<std::string, double> values);

  std::string kind_;
  c10::Dict<std::string, double> values_;
};

} // namespace optim
} // namespace torchrpc
