#pragma once

#include <cstdint>
#include <memory>

#include "torchrpc/autograd/backward.h"
#include "torchrpc/autograd/context_container.h"
#include "torchrpc/autograd/dist_context.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace autograd {

// Opens a distributed autograd context on the calling thread for as long as
// it lives: calls made from this thread, and from the handlers they reach,
// record their send/recv functions in it (see
// Note [Distributed autograd recording]). When it ends, the context is
// released here at once and every worker that joined it is told to release
// it; the destructor does not wait for their answers (a training loop would
// pay a round trip per iteration) and never throws.
// ContextContainer::waitForReleases() waits for them.
//
// Guards nest; a guard must end on the thread that opened it, before its
// runtime is destroyed.
class Context {
 public:
  explicit Context(rpc::Runtime& runtime);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int64_t id() const {
    return context_->id();
  }
  // What this worker recorded in the context.
  const DistContext& recorded() const {
    return *context_;
  }

  // autograd::backward() and getGradients() of this context; see
  // autograd/backward.h.
  void backward(
      const std::vector<at::Tensor>& roots,
      const BackwardOptions& options = {}) const;
  void backward(
      const std::vector<at::Tensor>& roots,
      const std::vector<at::Tensor>& grads,
      const BackwardOptions& options = {}) const;
  void backwardOnOwner(
      const rref::RRef<at::Tensor>& root,
      const BackwardOptions& options = {}) const;
  c10::Dict<at::Tensor, at::Tensor> gradients() const;

 private:
  rpc::Runtime& runtime_;
  std::shared_ptr<ContextContainer> container_;
  std::shared_ptr<DistContext> context_;
  std::pair<const ContextContainer*, int64_t> previous_;
};

} // namespace autograd
} // namespace torchrpc
