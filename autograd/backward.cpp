#include "torchrpc/autograd/backward.h"

#include <c10/util/Exception.h>

#include "torchrpc/autograd/context_container.h"
#include "torchrpc/autograd/engine/dist_engine.h"

namespace torchrpc {
namespace autograd {

namespace {

void waitAndRethrow(const c10::intrusive_ptr<c10::ivalue::Future>& future) {
  future->wait();
  if (future->hasError()) {
    std::rethrow_exception(future->exception_ptr());
  }
}

} // namespace

c10::intrusive_ptr<c10::ivalue::Future> backwardAsync(
    rpc::Runtime& runtime,
    int64_t contextId,
    const std::vector<at::Tensor>& roots,
    const std::vector<at::Tensor>& grads,
    const BackwardOptions& options) {
  return ContextContainer::of(runtime)->engine().backward(
      contextId,
      roots,
      grads,
      options);
}

void backward(
    rpc::Runtime& runtime,
    int64_t contextId,
    const std::vector<at::Tensor>& roots,
    const std::vector<at::Tensor>& grads,
    const BackwardOptions& options) {
  waitAndRethrow(backwardAsync(runtime, contextId, roots, grads, options));
}

void backwardOnOwner(
    rpc::Runtime& runtime,
    int64_t contextId,
    const rref::RRef<at::Tensor>& root,
    const BackwardOptions& options) {
  waitAndRethrow(ContextContainer::of(runtime)->engine().backwardOnOwner(
      contextId,
      root.toIValue(),
      options));
}

c10::Dict<at::Tensor, at::Tensor> getGradients(
    rpc::Runtime& runtime,
    int64_t contextId) {
  auto context = ContextContainer::of(runtime)->find(contextId);
  TORCH_CHECK(
      context,
      "no distributed autograd context ",
      contextId,
      " on worker '",
      runtime.self().name,
      "' (released, or never joined)");
  return context->gradients();
}

} // namespace autograd
} // namespace torchrpc
