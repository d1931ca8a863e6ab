#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdint>
#include <vector>

#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rref/rref.h"

namespace torchrpc {
namespace autograd {

// Options of one distributed backward pass.
struct BackwardOptions {
  // Keep the graph's saved tensors so that the context can run backward
  // again (the gradients of both passes add up in the context).
  bool retainGraph = false;
  // The whole pass must finish within this; zero means the runtime's
  // Options::defaultTimeout.
  std::chrono::milliseconds deadline{0};
};

// The distributed backward pass of context `contextId`, driven from this
// worker (see Note [Distributed backward] in autograd/engine/dist_engine.h).
//
// `roots` are tensors of this worker; `grads` their gradients (empty, or one
// per root; an undefined one is an implicit 1, allowed only for one-element
// roots). Returns when every worker's part is done; each worker's leaves'
// gradients are then in its context (getGradients), never in `.grad`.
//
// Throws c10::Error for misuse (no such context here, a root that does not
// require grad, a missing gradient) and rpc::RpcError when the pass fails:
// kRemoteException when a node or hook threw (naming the worker and node),
// kWorkerUnavailable when a worker died, kTimeout past the deadline (naming
// every send/recv pair that never got its gradient), kBadArguments for
// gradients a worker refused. A failed pass has released the context on
// every worker.
//
// Blocks the calling thread; inside a handler, use backwardAsync.
void backward(
    rpc::Runtime& runtime,
    int64_t contextId,
    const std::vector<at::Tensor>& roots,
    const std::vector<at::Tensor>& grads = {},
    const BackwardOptions& options = {});

// As backward(), without blocking: the future completes when the pass has
// ended (with the errors above), always in a task of the worker's pool, so
// its callbacks may block (each blocked callback holds a pool thread).
// Misuse still throws.
c10::intrusive_ptr<c10::ivalue::Future> backwardAsync(
    rpc::Runtime& runtime,
    int64_t contextId,
    const std::vector<at::Tensor>& roots,
    const std::vector<at::Tensor>& grads = {},
    const BackwardOptions& options = {});

// Runs the pass on the owner of `root` (a one-element tensor there), which
// drives it; returns when it has ended, with the errors above.
void backwardOnOwner(
    rpc::Runtime& runtime,
    int64_t contextId,
    const rref::RRef<at::Tensor>& root,
    const BackwardOptions& options = {});

// This worker's leaves -> their gradients in context `contextId`, summed
// over its passes so far (an empty dict before any). Throws c10::Error if
// the context is not on this worker. The gradients are shared with the
// context: treat them as read-only.
c10::Dict<at::Tensor, at::Tensor> getGradients(
    rpc::Runtime& runtime,
    int64_t contextId);

} // namespace autograd
} // namespace torchrpc
