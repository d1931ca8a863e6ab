#include "torchrpc/autograd/backward.h"

#include <c10/core/thread_pool.h>
#include <c10/util/Exception.h>

#include "torchrpc/autograd/context_container.h"
#include "torchrpc/autograd/engine/dist_engine.h"
#include "torchrpc/rpc/agent.h"
#include "torchrpc/rpc/future.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace autograd {

namespace {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// As rpc::Future::wait(): the waiting thread reads the answers that
// complete the pass itself (Note [Waiting callers drive the transport] in
// rpc/detail/wait_drivers.h), instead of being woken by the thread that
// read them. Rethrows the pass's error.
void waitAndRethrow(const FuturePtr& future) {
  rpc::Future<void>(future).wait();
}

// The engine's future completes where the pass's last answer is read, often
// on a transport's thread (DistEngine::backward); a caller's callbacks may
// wait or take long, so the future it is given completes on the pool. Always
// through a task: even a pool thread may be reading the transport's messages
// at that moment, while it waits for a call of its own (Note [Waiting
// callers drive the transport] in rpc/detail/wait_drivers.h).
FuturePtr completedOnThePool(rpc::Runtime& runtime, const FuturePtr& pass) {
  auto forCaller =
      c10::make_intrusive<c10::ivalue::Future>(pass->elementType());
  auto& pool = runtime.agent().threadPool();
  // Holding `pass` in its own callback is no cycle for long: a future drops
  // its callbacks once it has run them, and the pass always ends (its
  // deadline).
  pass->addCallback([&pool, forCaller, pass](c10::ivalue::Future&) {
    pool.run([forCaller, pass]() { rpc::completeFrom(*pass, *forCaller); });
  });
  return forCaller;
}

} // namespace

c10::intrusive_ptr<c10::ivalue::Future> backwardAsync(
    rpc::Runtime& runtime,
    int64_t contextId,
    const std::vector<at::Tensor>& roots,
    const std::vector<at::Tensor>& grads,
    const BackwardOptions& options) {
  return completedOnThePool(
      runtime,
      ContextContainer::of(runtime)->engine().backward(
          contextId,
          roots,
          grads,
          options));
}

void backward(
    rpc::Runtime& runtime,
    int64_t contextId,
    const std::vector<at::Tensor>& roots,
    const std::vector<at::Tensor>& grads,
    const BackwardOptions& options) {
  // Waits on the engine's own future: its last answer wakes this thread
  // directly, with no pool thread in between.
  waitAndRethrow(ContextContainer::of(runtime)->engine().backward(
      contextId,
      roots,
      grads,
      options));
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
