#include "torchrpc/autograd/context.h"

namespace torchrpc {
namespace autograd {

Context::Context(rpc::Runtime& runtime)
    : runtime_(runtime),
      container_(ContextContainer::of(runtime)),
      context_(container_->open()),
      previous_(
          ContextContainer::exchangeCurrent(container_.get(), context_->id())) {
}

Context::~Context() {
  ContextContainer::exchangeCurrent(previous_.first, previous_.second);
  // R4: without waiting for the other workers' answers.
  container_->releaseAsync(context_->id());
}

void Context::backward(
    const std::vector<at::Tensor>& roots,
    const BackwardOptions& options) const {
  autograd::backward(runtime_, id(), roots, {}, options);
}

void Context::backward(
    const std::vector<at::Tensor>& roots,
    const std::vector<at::Tensor>& grads,
    const BackwardOptions& options) const {
  autograd::backward(runtime_, id(), roots, grads, options);
}

void Context::backwardOnOwner(
    const rref::RRef<at::Tensor>& root,
    const BackwardOptions& options) const {
  autograd::backwardOnOwner(runtime_, id(), root, options);
}

c10::Dict<at::Tensor, at::Tensor> Context::gradients() const {
  return getGradients(runtime_, id());
}

} // namespace autograd
} // namespace torchrpc
