#include "torchrpc/autograd/dist_context.h"

#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/grad_mode.h>

#include "torchrpc/autograd/engine/local_backward.h"
#include "torchrpc/rpc/errors.h"

namespace torchrpc {
namespace autograd {

void DistContext::addSend(std::shared_ptr<SendFunction> send) {
  std::lock_guard<std::mutex> guard(mutex_);
  peers_.insert(send->toWorker());
  sends_.emplace(send->messageId(), std::move(send));
}

void DistContext::addRecv(std::shared_ptr<RecvFunction> recv) {
  std::lock_guard<std::mutex> guard(mutex_);
  peers_.insert(recv->fromWorker());
  recvs_.emplace(recv->messageId(), std::move(recv));
}

void DistContext::addPeer(int64_t worker) {
  std::lock_guard<std::mutex> guard(mutex_);
  peers_.insert(worker);
}

std::map<int64_t, std::shared_ptr<SendFunction>> DistContext::sends() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return sends_;
}

std::map<int64_t, std::shared_ptr<RecvFunction>> DistContext::recvs() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return recvs_;
}

std::set<int64_t> DistContext::peers() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return peers_;
}

std::shared_ptr<SendFunction> DistContext::findSend(int64_t messageId) const {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = sends_.find(messageId);
  return it == sends_.end() ? nullptr : it->second;
}

std::shared_ptr<RecvFunction> DistContext::findRecv(int64_t messageId) const {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = recvs_.find(messageId);
  return it == recvs_.end() ? nullptr : it->second;
}

std::shared_ptr<detail::LocalBackward> DistContext::addPass(
    std::shared_ptr<detail::LocalBackward> pass) {
  std::lock_guard<std::mutex> guard(mutex_);
  int64_t passId = pass->passId();
  return passes_.emplace(passId, std::move(pass)).first->second;
}

std::shared_ptr<detail::LocalBackward> DistContext::findPass(
    int64_t passId) const {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = passes_.find(passId);
  return it == passes_.end() ? nullptr : it->second;
}

void DistContext::removePass(int64_t passId) {
  std::shared_ptr<detail::LocalBackward> removed;
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = passes_.find(passId);
  if (it != passes_.end()) {
    removed = std::move(it->second);
    passes_.erase(it);
  }
}

std::map<int64_t, std::shared_ptr<detail::LocalBackward>> DistContext::passes()
    const {
  std::lock_guard<std::mutex> guard(mutex_);
  return passes_;
}

size_t DistContext::passCount() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return passes_.size();
}

namespace {

// Whether another tensor may read or write `grad`'s bytes: its storage has
// another owner than `grad` itself and, for a view, than its base when
// nothing else holds that base (a backward function's result is often a
// view, such as the transpose of a matmul, whose base only it keeps).
bool storageSeenElsewhere(const at::Tensor& grad) {
  if (grad.layout() != at::kStrided || !grad.has_storage()) {
    return false;
  }
  const auto owners = grad.storage().use_count();
  if (grad.is_view()) {
    return grad._base().use_count() > 1 || owners > 2;
  }
  return owners > 1;
}

} // namespace

void DistContext::accumulateGradients(
    std::vector<std::pair<at::Tensor, at::Tensor>> gradients) {
  // See Note [Gradient ownership].
  at::AutoGradMode gradMode(false);
  std::lock_guard<std::mutex> guard(mutex_);
  for (auto& entry : gradients) {
    const at::Tensor& leaf = entry.first;
    at::Tensor grad = std::move(entry.second);
    at::Tensor buffer;
    auto it = gradients_.find(leaf);
    if (it != gradients_.end()) {
      buffer = it->value();
    }
    // `grad` is the one reference this function may count on; a dense
    // gradient sharing its storage with another tensor counts as seen by
    // someone else, so it is copied (rule 1).
    const bool sharesStorage = storageSeenElsewhere(grad);
    if (!buffer.defined() && !sharesStorage && grad.layout() == at::kStrided &&
        grad.use_count() == 1 && grad.is_non_overlapping_and_dense()) {
      // Rule 1's exception: taken even when strided unlike the leaf.
      gradients_.insert_or_assign(leaf, grad.detach());
      continue;
    }
    const size_t expectedReferences = sharesStorage ? 0 : 1;
    torch::autograd::AccumulateGrad::accumulateGrad(
        leaf,
        buffer,
        grad,
        expectedReferences,
        [this, &leaf](at::Tensor&& update) {
          gradients_.insert_or_assign(leaf, std::move(update));
        });
  }
}

c10::Dict<at::Tensor, at::Tensor> DistContext::gradients() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return gradients_.copy();
}

void DistContext::close(std::exception_ptr why) {
  std::map<int64_t, std::shared_ptr<detail::LocalBackward>> passes;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    passes.swap(passes_);
  }
  for (auto& entry : passes) {
    if (why) {
      entry.second->fail(why);
      continue;
    }
    entry.second->fail(rpc::makeRpcError(
        rpc::ErrorCode::kShuttingDown,
        workerName_,
        "autograd.backward",
        0,
        "distributed autograd context " + std::to_string(id_) +
            " was released during the pass"));
  }
}

} // namespace autograd
} // namespace torchrpc
