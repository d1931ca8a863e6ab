#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace torchrpc {
namespace autograd {

// Note [Parameters updated while backward passes are pending]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Background. A forward pass saves, for its backward, the tensors it used:
// a parameter used by `x * w` is saved as `w` itself (libtorch saves leaves
// as the very tensor, and checks its version counter when unpacking). When
// several trainers share parameters, trainer B's optimizer step can come
// between trainer A's forward and A's backward. An in-place step (what every
// libtorch optimizer does) then either breaks A's backward ("modified by an
// inplace operation": PyTorch's parameter-server tutorial with two trainers)
// or, had the check been skipped, computes A's gradient with values A's
// forward never saw.
//
// Rule: a parameter managed by torchrpc (a parameter RRef stepped by a
// DistributedOptimizer, a RemoteModule's parameters) is never written in
// place once published. An update computes the new values apart (each local
// optimizer keeps its own copy of the parameters it steps) and publishes
// them as a new tensor, a new *version*: the parameter RRef's value is
// replaced (RRef::setLocalValue), and a RemoteModule builds a new replica of
// its module around the new values. Forwards that start afterwards use the
// new version; those that started before keep the tensors they saved,
// unchanged, so every backward computes its gradient with the parameter
// values its own forward used (asynchronous SGD).
//
// This class is what makes the versions one parameter again: each worker
// maps every version it publishes to its parameter's *slot*, so that an
// optimizer step finds the gradient of "parameter i" in a context whatever
// version the context's forward used, summing over versions when a context
// used several. It also serializes the updates on this worker
// (lockUpdates), so that two trainers' steps on shared parameters never
// interleave and none is lost.
//
// Cost: per step, one copy of each stepped parameter into the optimizer's
// own copy (skipped when that optimizer published the current version) and
// one copy out as the new version; a version stays in memory while a pending
// backward pass still holds it. A RemoteModule also builds a new replica of
// its module (its registered factory, then a copy of the values) on the first
// forward after a step. Lookups are a hash probe per gradient.
//
// Versions are held weakly: a slot never keeps an old version's memory alive.
class ParameterVersions {
 public:
  // The slot of `tensor`; a tensor never seen before becomes the first
  // version of a new slot.
  int64_t slotOf(const at::Tensor& tensor);
  // The slot of `tensor`, or -1 if it is no version of any.
  int64_t find(const at::Tensor& tensor) const;
  // Records `version` as a newer value of slot `slot`.
  void add(int64_t slot, const at::Tensor& version);

  // The gradients of `gradients` (a context's, leaf -> gradient) that belong
  // to slots, summed per slot; gradients of other leaves are left out.
  std::unordered_map<int64_t, at::Tensor> bySlot(
      const c10::Dict<at::Tensor, at::Tensor>& gradients) const;

  // Serializes parameter updates on this worker.
  std::unique_lock<std::mutex> lockUpdates() {
    return std::unique_lock<std::mutex>(updates_);
  }

  // Live versions known (for tests and metrics).
  size_t size() const;

 private:
  using WeakImpl =
      c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
  struct Entry {
    // Keeps the address from being reused while the entry exists; never the
    // tensor's memory.
    WeakImpl version;
    int64_t slot;
  };

  int64_t findLocked(const at::Tensor& tensor) const;
  void addLocked(int64_t slot, const at::Tensor& version);
  void pruneLocked();

  mutable std::mutex mutex_;
  std::unordered_map<const c10::TensorImpl*, Entry> versions_;
  int64_t nextSlot_ = 0;
  size_t pruneAt_ = 64;
  std::mutex updates_;
};

} // namespace autograd
} // namespace torchrpc
