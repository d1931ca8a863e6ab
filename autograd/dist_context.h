#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
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

// What one worker records of one distributed autograd context: the send and
// recv functions of the messages it sent and received in it, the workers it
// exchanged them with (who must release the context too), the backward
// passes running here and the gradients they left for this worker's leaves.
// Thread-safe.
class DistContext {
 public:
  explicit DistContext(int64_t id) : id_(id) {}

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

  // Adds a pass's leaf gradients to what earlier passes left.
  void accumulateGradients(
      std::vector<std::pair<at::Tensor, at::Tensor>> gradients);
  // Leaf -> gradient, summed over the passes that ended here. The tensors
  // may be shared with other gradients: treat them as read-only.
  c10::Dict<at::Tensor, at::Tensor> gradients() const;

  // The context is released: fails the passes still running here.
  void close();

 private:
  const int64_t id_;
  mutable std::mutex mutex_;
  std::map<int64_t, std::shared_ptr<SendFunction>> sends_;
  std::map<int64_t, std::shared_ptr<RecvFunction>> recvs_;
  std::set<int64_t> peers_;
  std::map<int64_t, std::shared_ptr<detail::LocalBackward>> passes_;
  c10::Dict<at::Tensor, at::Tensor> gradients_;
};

} // namespace autograd
} // namespace torchrpc
