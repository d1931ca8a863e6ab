#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "torchrpc/autograd/backward.h"
#include "torchrpc/autograd/dist_context.h"
#include "torchrpc/autograd/engine/local_backward.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace autograd {

// Note [Distributed backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Background: the forward pass left, on each worker of a context, pieces of
// libtorch's autograd graph joined across workers by send/recv pairs (see
// Note [Distributed autograd recording]): a RecvFunction on the receiver
// stands for the tensors' history on the sender, whose SendFunction's next
// edges lead into it. Together the pieces form one acyclic graph (every
// edge points from a later computation to an earlier one), even when
// messages go back and forth between two workers.
//
// libtorch's engine runs a local graph from chosen edges, but it decides
// which nodes to run per execute() call: a node reached from two places
// whose gradients become available at different times (say, a local root
// and a gradient that comes back through another worker) would run twice
// with partial gradients, or wait forever. So each worker schedules its
// part of the pass itself, with dependency counts over the whole
// distributed graph, and runs each node through its public interface
// (Node::operator(), with the hooks libtorch's engine runs).
//
// A pass is driven by one worker (the one backward() is called on; for an
// RRef root, the RRef's owner). Steps:
//  D1. The driver checks the roots and their gradients (an implicit 1 for
//      one-element roots) and takes each root's gradient edge.
//  D2. Discovery. Each worker walks its graph from what the pass reaches
//      there (the roots on the driver; marked sends elsewhere), counting
//      for every node it reaches the edges that reach it. A RecvFunction
//      ends the walk; its sender is sent kDiscover naming the send, which
//      marks it (one gradient message will come for it) and walks on from
//      it. A worker answers kDiscover when the workers its walk reached
//      have answered. Each send is marked, and each node walked, at most
//      once per pass, so discovery ends; when the driver's kDiscover calls
//      have all been answered, every worker knows all it will receive.
//  D2'. Shortcut: each SendFunction knows whether the graph behind it
//      reaches any RecvFunction (SendFunction::graphIsFinal, fixed when it
//      is recorded since nodes only point to older nodes; known without a
//      walk while the process holds no RecvFunction), and its message
//      tells the receiver's RecvFunction. When every RecvFunction the
//      driver's own walk reaches came from another worker whose graph
//      behind it is final, discovery could only mark those sends, so the
//      driver skips it: in E1 each such worker's kAwait names the sends to
//      mark. Since messages may be handled out of order, such a worker
//      holds gradients that come before its kAwait and runs nothing until
//      the kAwait has marked its sends. This saves the discovery round
//      trip in the common shape of a trainer calling servers.
//  E1. The driver sends kAwait to every worker discovery reached and
//      delivers the roots' gradients.
//  E2. A node runs when its count reaches zero, with the sum of the
//      gradients that reached it; its outputs go along its next edges. A
//      marked send counts its gradient message; a RecvFunction whose count
//      reaches zero sends its gradients to its sender (kGradients); a leaf
//      (AccumulateGrad, never run) collects its gradient for the context.
//  E3. A worker's part is done when every send marked there got its
//      gradients, nothing is ready to run, and every gradient message it
//      sent was answered (the receiver has taken it). Its leaves' gradients
//      then pass the leaves' hooks and are added to the context's
//      gradients, and its kAwait is answered.
//  E4. The pass ends when the driver's own part and every kAwait are done.
//      On the first error anywhere — a node or hook that throws, refused or
//      undeliverable gradients, a worker that dies, the deadline — the
//      driver sends kAbort to every worker reached (each answers with the
//      sends it still waited for), releases the context everywhere, and the
//      pass fails with that error.
//
// Guarantees:
//  G1. Exact: every node a pass reaches runs exactly once, after all its
//      gradients arrived, so gradients equal single-process autograd (up to
//      the order in which three or more gradients of one input are added).
//  G2. Nothing waits for what cannot come: a RecvFunction the roots do not
//      reach is never discovered, so its send (an output that never reached
//      the loss) is not waited for.
//  G3. Bounded: the pass completes, successfully or with an error naming
//      the worker and cause, within its deadline (plus the bounded time to
//      abort and release); on expiry the error names every send/recv pair
//      whose gradient never came.
//  G4. Gradients never touch .grad: each worker adds its leaves' gradients
//      to its context (getGradients), so contexts never mix.
//
// Limits: create_graph (higher order gradients through the distributed
// graph) is not supported. A pass holds the nodes it reaches until it ends.
class DistEngine : public std::enable_shared_from_this<DistEngine> {
 public:
  // What the engine needs of its worker's contexts (the ContextContainer,
  // which owns the engine). Each may be called on any thread.
  struct ContextTable {
    // The context of that id here, or nullptr.
    std::function<std::shared_ptr<DistContext>(int64_t id)> find;
    // The context, created if new; throws for a released one.
    std::function<std::shared_ptr<DistContext>(int64_t id)> join;
    // Releases the context here and on every worker it reached (E4); the
    // future completes when they answered.
    std::function<c10::intrusive_ptr<c10::ivalue::Future>(int64_t id)> release;
  };

  DistEngine(rpc::Runtime& runtime, ContextTable contexts);

  // Registers the message kinds of the pass (autograd/messages.h) before
  // start().
  void registerWithAgent();

  // Runs a pass in context `contextId` from `roots` (with `grads`, or an
  // implicit 1 for one-element roots). Throws c10::Error for misuse found
  // before anything is sent; every later failure completes the future with
  // an rpc::RpcError. The future completes on whichever thread ends the
  // pass, often the one that reads its last answer (a transport's, or a
  // caller's that drives the transport): its callbacks must be short and
  // never wait (backwardAsync() hands it to the pool for its callers).
  c10::intrusive_ptr<c10::ivalue::Future> backward(
      int64_t contextId,
      const std::vector<at::Tensor>& roots,
      const std::vector<at::Tensor>& grads,
      const BackwardOptions& options);

  // Runs a pass on the owner of `root` (an RRef of a tensor, as an IValue);
  // its future completes as backward()'s does.
  c10::intrusive_ptr<c10::ivalue::Future> backwardOnOwner(
      int64_t contextId,
      const c10::IValue& root,
      const BackwardOptions& options);

 private:
  // The driver's state of one pass after D1, and its E4 continuations.
  struct DrivenPass;

  std::chrono::milliseconds deadlineOf(const BackwardOptions& options) const;
  std::shared_ptr<DistContext> contextOrThrow(int64_t contextId) const;
  // The pass of that id in `context`, created if new (messages of one pass
  // may race to create it); holdsDeliveries (on a worker reached without
  // discovery, D2') makes a new one wait for the kAwait that names its
  // sends.
  std::shared_ptr<detail::LocalBackward> findOrCreatePass(
      const std::shared_ptr<DistContext>& context,
      int64_t passId,
      bool retainGraph,
      bool holdsDeliveries);
  // D2 (or D2' when discovery ends here), then E1, for a pass whose roots
  // reached `reached`.
  void discoverThenRun(
      const std::shared_ptr<DrivenPass>& driven,
      const std::shared_ptr<detail::LocalBackward>& pass,
      const std::shared_ptr<DistContext>& context,
      const detail::LocalBackward::NewlyReached& reached);
  // E1: kAwait to each of `workers` (naming the sends to mark there when
  // discovery was skipped: `marks`), then the roots' gradients; the future
  // completes with the first error or when every part is done.
  c10::intrusive_ptr<c10::ivalue::Future> runPass(
      int64_t contextId,
      const std::shared_ptr<detail::LocalBackward>& pass,
      const std::vector<int64_t>& workers,
      const detail::LocalBackward::NewlyReached* marks,
      std::chrono::milliseconds timeout);
  // D2: sends kDiscover for what a walk newly reached; the future's value
  // is the list of worker ids reached.
  c10::intrusive_ptr<c10::ivalue::Future> discover(
      int64_t contextId,
      int64_t passId,
      bool retainGraph,
      const detail::LocalBackward::NewlyReached& reached,
      std::chrono::milliseconds timeout);
  void sendGradients(
      int64_t contextId,
      const std::shared_ptr<detail::LocalBackward>& pass,
      const std::shared_ptr<RecvFunction>& recv,
      torch::autograd::variable_list grads);
  // E4 on failure.
  c10::intrusive_ptr<c10::ivalue::Future> abortPass(
      int64_t contextId,
      int64_t passId,
      const std::vector<int64_t>& workers,
      std::exception_ptr error,
      std::chrono::milliseconds deadline);

  c10::intrusive_ptr<c10::ivalue::Future> onDiscover(rpc::Request&& request);
  c10::intrusive_ptr<c10::ivalue::Future> onGradients(rpc::Request&& request);
  c10::intrusive_ptr<c10::ivalue::Future> onAwait(rpc::Request&& request);
  c10::intrusive_ptr<c10::ivalue::Future> onAbort(rpc::Request&& request);
  c10::intrusive_ptr<c10::ivalue::Future> onBackwardOnOwner(
      rpc::Request&& request);

  std::string workerName(int64_t id) const;

  rpc::Runtime& runtime_;
  rpc::Agent& agent_;
  const ContextTable contexts_;
  const int64_t selfId_;
  std::atomic<int64_t> nextPassId_{1};
};

} // namespace autograd
} // namespace torchrpc
