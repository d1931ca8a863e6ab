#pragma once

// Private to optim/: the part of a DistributedOptimizer that lives on one
// owner, held there through an RRef (a torch custom class, so that it never
// leaves its owner), and the functions the caller reaches it through.

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "torchrpc/autograd/context_container.h"
#include "torchrpc/optim/detail/flat_optimizer.h"
#include "torchrpc/optim/optimizer_options.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rref/rref.h"

namespace torchrpc {
namespace optim {
namespace detail {

// Names of the owner-side functions.
constexpr const char* kCreate = "torchrpc.optim.create";
constexpr const char* kStep = "torchrpc.optim.step";
constexpr const char* kSetLearningRate = "torchrpc.optim.set_lr";
constexpr const char* kStateBytes = "torchrpc.optim.state_bytes";
constexpr const char* kLoadBytes = "torchrpc.optim.load_bytes";
constexpr const char* kSaveFile = "torchrpc.optim.save_file";
constexpr const char* kLoadFile = "torchrpc.optim.load_file";
constexpr const char* kStepCount = "torchrpc.optim.step_count";
constexpr const char* kSetParameter = "torchrpc.optim.set_parameter";

// One libtorch optimizer over the parameters one worker owns. It steps its
// own copies of the parameters and publishes each result as a new version
// (see Note [Parameters updated while backward passes are pending]).
class LocalOptimizer : public torch::CustomClassHolder {
 public:
  LocalOptimizer(
      std::weak_ptr<autograd::ContextContainer> container,
      const OptimizerOptions& options,
      std::vector<rref::RRef<at::Tensor>> parameters);

  // Applies context `contextId`'s gradients; returns how many parameters
  // had one (0 when the context never reached this worker).
  int64_t step(int64_t contextId);
  void setLearningRate(double lr);
  // The whole state (libtorch's optimizer archive plus what checks a load).
  std::string save();
  // Restores save()'s bytes; returns the restored learning rate. Throws
  // c10::Error naming the mismatch if the bytes are another optimizer's.
  double load(const char* data, size_t size);
  int64_t stepCount() const;

 private:
  void writeArchive(torch::serialize::OutputArchive& archive);

  const std::weak_ptr<autograd::ContextContainer> container_;
  const std::string kind_;
  const std::vector<rref::RRef<at::Tensor>> parameters_;
  std::vector<int64_t> slots_;
  // The version each of the optimizer's own copies of the parameters
  // (optimizer_.parameters(), which it steps in place) was last published
  // as, so that a copy is
  // refreshed only when another optimizer or a module published since.
  std::vector<at::Tensor> published_;

  mutable std::mutex mutex_;
  std::unique_ptr<FlatOptimizer> optimizer_;
  int64_t steps_ = 0;
};

// Registers the owner-side functions on `runtime` (every worker needs them:
// any worker may own parameters).
void registerOwnerFunctions(rpc::Runtime& runtime);

} // namespace detail
} // namespace optim
} // namespace torchrpc
