#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>

#include "torchrpc/autograd/send_recv_functions.h"

namespace torchrpc {
namespace autograd {

namespace detail {
// One worker's part of a backward pass; private to the engine
// (autograd/engine/local_backward.h).
class LocalBackward;
} // namespace detail

// Note [Gradient ownership]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A context owns the gradient buffers it holds, as a leaf owns its .grad:
// the user may clip, scale or step them in place without touching anything
// else. The rules are libtorch's own, applied by calling
// torch::autograd::AccumulateGrad::accumulateGrad (with grad mode off, as
// distributed backward has no higher-order gradients):
//  1. A leaf's first gradient is taken without a copy only when nothing else
//     can see it: no other reference to the tensor (it is not also another
//     leaf's gradient, nor held by the graph or a hook), no other tensor on
//     its storage (it is not a view of, or the storage of, another tensor),
//     and it obeys the gradient layout contract (dense, non-overlapping,
//     strided like the leaf; an expanded, stride-0 gradient does not).
//     Otherwise it is copied into a buffer laid out like the leaf.
//     One exception, ours: a gradient nothing else sees that is dense and
//     non-overlapping but strided unlike its leaf is taken as it is.
//     libtorch would copy it to the leaf's layout; every Linear layer's
//     weight gradient is such a transposed tensor, and copying them cost
//     the distributed backward benchmark about 3 ms an iteration (4 x 4 MiB,
//     transposing). In-place changes and later accumulation work on any
//     strides.
//  2. A sparse gradient is taken when its indices and values are contiguous
//     and unshared, and cloned otherwise.
//  3. A later gradient is added into the buffer in place; sparse + sparse
//     stays sparse, a dense gradient into a sparse buffer makes it dense
//     (a new buffer), a sparse gradient into a dense buffer adds in place.
// Rule 1's "no other tensor on its storage" is ours: libtorch checks only
// the tensor's references, and a gradient that came over the wire or out of
// a view could otherwise share bytes with another buffer. A view whose base
// nothing but the view holds (a transposed matmul result) counts as alone.

// What one worker records of one distributed autograd context: the send and
// recv functions of the messages it sent and received in it, the workers it
// exchanged them with (who must release the context too), the backward
// passes running here and the gradients they left for this worker's leaves.
// Thread-safe.
class DistContext {
 public:
  // workerName: this worker, named in the errors the context raises.
  DistContext(int64_t id, std::string workerName)
      : id_(id),
        workerName_(std::move(workerName)) {}

  int64_t id() const {
    return id_;
  }

  void addSend(std::shared_ptr<SendFunction> send);
  void addRecv(std::shared_ptr<RecvFunction> recv);
  void addPeer(int64_t worker);

  // By message id.
  std::map<int64_t, std::shared_ptr<SendFunction>> sends() const;
  std::map<int64_t, std::shared_ptr<RecvFunction>> recvs() const;
  std::set<int64_t> peers() const;
  std::shared_ptr<SendFunction> findSend(int64_t messageId) const;
  std::shared_ptr<RecvFunction> findRecv(int64_t messageId) const;

  // Backward passes (see Note [Distributed backward]), kept here so that
  // releasing the context fails them; used by the engine.
  // Adds the pass unless one of its id is there already; returns the one
  // that is (messages of one pass may race to create it).
  std::shared_ptr<detail::LocalBackward> addPass(
      std::shared_ptr<detail::LocalBackward> pass);
  std::shared_ptr<detail::LocalBackward> findPass(int64_t passId) const;
  void removePass(int64_t passId);
  size_t passCount() const;
  // Every running pass, by id (hang reports).
  std::map<int64_t, std::shared_ptr<detail::LocalBackward>> passes() const;

  // Adds a pass's leaf gradients (leaf, gradient) to what earlier passes
  // left, taking or copying each as Note [Gradient ownership] says.
  void accumulateGradients(
      std::vector<std::pair<at::Tensor, at::Tensor>> gradients);
  // Leaf -> gradient, summed over the passes that ended here. Each is this
  // context's own buffer (Note [Gradient ownership]): changing one in place
  // changes no other tensor, and later passes of the context accumulate
  // into it.
  c10::Dict<at::Tensor, at::Tensor> gradients() const;

  // The context is released: fails the passes still running here, with
  // `why` if given.
  void close(std::exception_ptr why = nullptr);

 private:
  const int64_t id_;
  const std::string workerName_;
  mutable std::mutex mutex_;
  std::map<int64_t, std::shared_ptr<SendFunction>> sends_;
  std::map<int64_t, std::shared_ptr<RecvFunction>> recvs_;
  std::set<int64_t> peers_;
  std::map<int64_t, std::shared_ptr<detail::LocalBackward>> passes_;
  c10::Dict<at::Tensor, at::Tensor> gradients_;
};

} // namespace autograd
} // namespace torchrpc
