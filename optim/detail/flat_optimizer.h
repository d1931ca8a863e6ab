#pragma once

// Private to optim/: one libtorch optimizer over the parameters of one owner,
// stepped as one flat tensor whenever the result is the same.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "torchrpc/optim/optimizer_options.h"

namespace torchrpc {
namespace optim {
namespace detail {

// Note [One flat step per owner]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// libtorch's optimizers run about eight eager tensor operations per
// parameter per step, each a few microseconds of dispatch whatever its size:
// Adam over 50 parameters of 1024 floats takes ~0.8-1.6 ms, Adam over the
// same 51200 floats as one tensor ~0.1 ms. Every optimizer torchrpc offers
// (SGD, Adam, AdamW, Adagrad, RMSprop) is elementwise, so stepping the
// concatenation gives every element the very value the per-parameter step
// gives it (bitwise: the kernels compute each element alike; the tests check
// it against libtorch's per-parameter optimizer).
//
// So two libtorch optimizers of the kind hold the parameters: a
// per-parameter one (libtorch's own semantics, the one checkpoints and
// learning rates are read from), and a flat one over one buffer of all the
// values, of which the parameters are then views. The values and the state
// (moments, step counts) live in exactly one of them at a time:
// - a step where every parameter has a dense gradient moves the state into
//   the flat optimizer if it can be one state (every parameter has state with
//   the same step count, or none has any), and steps the flat buffer;
// - any other step (a parameter without a gradient, which libtorch skips and
//   whose step count then lags; a sparse gradient) moves the state back per
//   parameter and runs the per-parameter optimizer;
// - saving and loading move it per parameter: checkpoints hold libtorch's
//   per-parameter form.
// Once step counts differ they stay per parameter (libtorch's rule), and so
// does the slow path; parameters of mixed dtypes or devices never fuse.
class FlatOptimizer {
 public:
  // Copies `initial` (the values, whatever their strides) into the buffer.
  FlatOptimizer(
      const OptimizerOptions& options,
      const std::vector<at::Tensor>& initial);

  // The values the optimizer steps, in order: write into them (copy_) to
  // change a parameter between steps; read them after a step. step(),
  // save() and load() may replace the tensors (not their values).
  const std::vector<at::Tensor>& parameters() const {
    return parameters_;
  }

  // A new tensor holding parameter i's value now (contiguous, no grad).
  at::Tensor copyOf(size_t i) const;

  // One step; `gradients[i]` is parameter i's (undefined: none, and the
  // parameter is skipped as libtorch skips it). Returns how many stepped.
  int64_t step(const std::vector<at::Tensor>& gradients);

  double learningRate() const;
  void setLearningRate(double lr);
  // libtorch's own archive of the per-parameter optimizer.
  void save(torch::serialize::OutputArchive& archive);
  void load(torch::serialize::InputArchive& archive);

  // Whether the state is in the flat optimizer now (for tests).
  bool fused() const {
    return fused_;
  }

 private:
  bool canStepFlat(const std::vector<at::Tensor>& gradients) const;
  // Move the state between the two optimizers; toFlat() returns false, and
  // moves nothing, when the parameters' states cannot be one.
  bool toFlat();
  void toPerParameter();

  at::Tensor flat_;
  at::Tensor flatGradient_;
  // The parameters as views of flat_, and the ones in use: views_ when
  // fused, the per-parameter optimizer's own tensors otherwise.
  std::vector<at::Tensor> views_;
  std::vector<at::Tensor> parameters_;
  std::unique_ptr<torch::optim::Optimizer> perParameter_;
  // Null when the parameters cannot share a buffer.
  std::unique_ptr<torch::optim::Optimizer> whole_;
  bool fused_ = false;
};

} // namespace detail
} // namespace optim
} // namespace torchrpc
