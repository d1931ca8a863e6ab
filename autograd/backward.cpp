#include "torchrpc/autograd/backward.h"

#include <c10/util/Exception.h>

#include "torchrpc/autograd/context_container.h"
#include "torchrpc/autograd/engine/dist_engine.h"
#include "torchrpc/rpc/future.h"

namespace torchrpc {
namespace autograd {

namespace {

// As rpc::Future::wait(): the waiting thread reads the answers that
// complete the pass itself (Note [Waiting callers drive the transport] in
// rpc/detail/wait_drivers.h), instead of being woken by the thread that
// read them. Rethrows the pass's error.
void waitAndRethrow(const c10::intrusive_ptr<c10::ivalue::Future>& future) {
  rpc::Future<void>(future).wait();
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
