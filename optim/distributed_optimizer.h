#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "torchrpc/optim/optimizer_options.h"
#include "torchrpc/rpc/future.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rref/rref.h"

namespace torchrpc {
namespace optim {

namespace detail {
class LocalOptimizer;
} // namespace detail

// Updates parameters where they live. Built from parameter RRefs on any
// workers (owner RRefs of this worker included) and a libtorch optimizer's
// options; each owner runs one libtorch optimizer of that kind over the
// parameters it owns.
//
//   DistributedOptimizer opt(rt, model.remoteParameters(),
//                            torch::optim::AdamOptions(1e-3));
//   {
//     torchrpc::autograd::Context context(rt);
//     context.backward({loss});
//     opt.step(context.id());
//   }
//
// A step applies the gradients of one distributed autograd context, on every
// owner at once. Several trainers may step concurrently on shared
// parameters, each with its own DistributedOptimizer (and so its own
// momentum or Adam moments, as in PyTorch): steps on one owner are
// serialized, contexts never mix, no update is lost, and each backward pass
// gets the parameter values its own forward used — see
// Note [Parameters updated while backward passes are pending] in
// autograd/parameter_versions.h for how, and what it costs. `.grad` of the
// parameters is left as it was.
//
// Beyond PyTorch's: the whole state (momentum buffers, Adam moments, step
// counts, options) saves and loads in libtorch's serialize format, each
// owner's part where it lives or gathered here; the learning rate changes on
// every owner (setLearningRate, and the schedulers of optim/lr_scheduler.h).
//
// Errors are rpc::RpcError naming the worker: the constructor waits until
// every owner has built its part (an owner that is gone, an RRef whose
// creation failed), and a step that fails on some owner names it and says
// on which owners it was applied.
class DistributedOptimizer {
 public:
  DistributedOptimizer(
      rpc::Runtime& runtime,
      const std::vector<rref::RRef<at::Tensor>>& parameters,
      const OptimizerOptions& options);
  ~DistributedOptimizer();
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  // Applies context `contextId`'s gradients on every owner, in parallel, and
  // returns when all are done. Parameters that got no gradient in that
  // context are left alone; a context with no gradient for any of this
  // optimizer's parameters is an error (kBadArguments), as is a failed
  // owner (its error, naming it, with where the step was applied).
  void step(int64_t contextId);
  // As step(), without blocking.
  rpc::Future<void> stepAsync(int64_t contextId);

  // Sets the learning rate of every parameter group on every owner.
  void setLearningRate(double lr);
  // The learning rate set last (by the options, setLearningRate or a load).
  double learningRate() const {
    return learningRate_;
  }

  // The whole state gathered here into one file (libtorch's serialize
  // format: one archive per owner inside), and its inverse. A load checks
  // that the file holds the state of the same optimizer kind over the same
  // owners and parameter shapes, and names what differs.
  void save(const std::string& path) const;
  void load(const std::string& path);
  // Each owner saves its own part to (loads it from) `prefix + owner name +
  // ".pt"` on its own file system; nothing travels.
  void saveOnOwners(const std::string& prefix) const;
  void loadOnOwners(const std::string& prefix);

  // The owners, in the order of their first parameter.
  std::vector<std::string> owners() const;
  // How many steps each owner has applied (in owners() order).
  std::vector<int64_t> stepCounts() const;
  const std::string& kind() const {
    return kind_;
  }

 private:
  struct OwnerPart;

  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> onEveryOwner(
      const std::function<c10::intrusive_ptr<c10::ivalue::Future>(
          const OwnerPart&)>& call) const;

  // Traces the steps and counts them (Runtime::step()); outlives this.
  rpc::Runtime& runtime_;
  std::string selfName_;
  std::string kind_;
  double learningRate_;
  std::vector<std::shared_ptr<OwnerPart>> parts_;
};

// Gives a parameter a new value (a copy of `value`, same shape and dtype),
// as a new version (see Note [Parameters updated while backward passes are
// pending]): how a checkpointed parameter is restored. Runs on the owner;
// returns once it is done there. Throws rpc::RpcError naming the owner.
void setParameter(
    rpc::Runtime& runtime,
    const rref::RRef<at::Tensor>& parameter,
    const at::Tensor& value);

// Makes `runtime` able to own parameters that DistributedOptimizers step (it
// registers the owner-side functions). torchrpc::Runtime does it; a bare
// rpc::Runtime with the rref and autograd layers calls it before start().
void installOwnerSide(rpc::Runtime& runtime);

} // namespace optim
} // namespace torchrpc
