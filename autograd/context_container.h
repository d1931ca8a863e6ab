#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torchrpc/autograd/dist_context.h"
#include "torchrpc/autograd/parameter_versions.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rpc/runtime_layer.h"

namespace torchrpc {
namespace autograd {

// The distributed backward engine (private: autograd/engine/dist_engine.h).
class DistEngine;

// Note [Distributed autograd recording]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A context is opened on a driving thread by an autograd::Context guard. Its
// id is unique across the job: the opening worker's id in the top 16 bits, a
// counter of that worker below. Each worker keeps the contexts it takes part
// in in its ContextContainer (owned by its Runtime).
//
// Which context a message belongs to: a request sent from a thread that has
// a guard open belongs to the guard's context; a request sent while serving
// a request of context C (on the handler's thread, or in a continuation
// chained with rpc::Future::then from it) belongs to C; a response belongs
// to the context of the request it answers.
//
// Rules:
//  R1. Every request that belongs to a context carries the context id (as
//      the "autograd" metadata of rpc/'s hooks), whether or not its tensors
//      require grad, so that its handler's nested calls and its response
//      can belong to the context too.
//  R2. A message whose tensors include some that require grad gets a
//      message id (job-unique, as context ids are). The sender records a
//      SendFunction whose next edges are those tensors' gradient edges; the
//      receiver joins the context (creates it if new) and records a
//      RecvFunction, which becomes those tensors' grad_fn. Both are nodes of
//      libtorch's own autograd graph, keyed by the message id.
//  R3. Tensors that do not require grad, and messages outside any context,
//      record nothing and carry no metadata.
//  R4. Releasing a context (the guard ends) removes it here at once and
//      sends kReleaseContext to every worker this one exchanged messages
//      with in it; each does the same for its own peers before answering.
//      A release names its context in its body and belongs to no context
//      (autograd::belongsToNoForward), also when it is sent from a thread
//      still inside the context, as after a pass that failed here alone.
//      The guard does not wait for the answers (a training loop would pay a
//      round trip per iteration for nothing); waitForReleases() does, and
//      graceful shutdown waits for them as for every call in flight. A
//      worker remembers the last kMaxReleased released ids and refuses to
//      join them again: a message of a released context fails with
//      kBadArguments.
//  R5. When a worker is lost (Note [Lost workers]), the passes of every
//      context it took part in here, or opened, fail with
//      kWorkerUnavailable naming it. Such a context is released here and on
//      its other workers as in R4 (the lost worker cannot do it), except on
//      the worker that opened it, where it stays for its guard (its next
//      pass fails on the lost worker, naming it). Releases skip lost
//      workers.
//
// Guarantees:
//  G1. Contexts never mix: what a message records goes into the context it
//      belongs to only, however many contexts are open at once.
//  G2. Once a guard's releases are answered (waitForReleases() on the
//      guard's worker returns true), no worker holds its context (counters
//      show it).
class ContextContainer : public rpc::RuntimeLayer,
                         public std::enable_shared_from_this<ContextContainer> {
 public:
  static constexpr size_t kMaxReleased = 1 << 16;

  // Adds the layer to `runtime` (before start()) and returns it.
  static std::shared_ptr<ContextContainer> install(rpc::Runtime& runtime);
  // The layer of `runtime`; throws c10::Error if it was not installed.
  static std::shared_ptr<ContextContainer> of(rpc::Runtime& runtime);

  // Counters, readable by tests and metrics.
  struct Counters {
    size_t liveContexts = 0;
    size_t sendFunctions = 0;
    size_t recvFunctions = 0;
    // Backward passes running on this worker.
    size_t livePasses = 0;
  };
  Counters counters() const;

  // A new context opened here (used by the autograd::Context guard).
  std::shared_ptr<DistContext> open();
  // The context of that id on this worker, or nullptr.
  std::shared_ptr<DistContext> find(int64_t id) const;
  // R4: releases the context here at once and on every worker it reached;
  // the future completes when every worker answered (with the first error,
  // if any). Never throws.
  c10::intrusive_ptr<c10::ivalue::Future> releaseAsync(int64_t id);
  // Waits until every release started here so far has been answered (or
  // failed; failures are logged); false if some are still unanswered after
  // `timeout`.
  bool waitForReleases(std::chrono::milliseconds timeout);

  // Runs the distributed backward passes of this worker's contexts. The
  // type is private to the layer; programs use autograd/backward.h.
  DistEngine& engine() const {
    return *engine_;
  }

  // The versions of the parameters updated on this worker (see
  // Note [Parameters updated while backward passes are pending]).
  ParameterVersions& parameterVersions() {
    return parameterVersions_;
  }

  // The context the calling thread's messages belong to (see the Note),
  // or -1.
  int64_t currentContextId() const;

  // ---- RuntimeLayer ---------------------------------------------------
  std::string name() const override;
  // Releases, here and on their other workers, the contexts the lost worker
  // opened or exchanged messages with here, failing their passes with an
  // error naming it (Note [Distributed autograd recording], R5).
  void workerLost(const rpc::WorkerInfo& worker, const std::string& cause)
      override;
  void closed() override;
  // Contexts, send/recv functions, passes (Counters), and releases in
  // flight.
  void reportMetrics(rpc::LayerMetrics& out) const override;
  // Per running pass: the recv functions whose gradients have not arrived,
  // and from which worker (Runtime::hangReport()).
  void describeWaits(std::vector<std::string>& out) const override;

 private:
  struct Token {};

 public:
  ContextContainer(Token, rpc::Runtime& runtime);

 private:
  friend class Context;
  // Makes (container, id) the guard open on this thread; returns the
  // previous one.
  static std::pair<const ContextContainer*, int64_t> exchangeCurrent(
      const ContextContainer* container,
      int64_t id);

  void registerWithAgent();
  int64_t mintId(std::atomic<int64_t>& counter) const;

  void onSend(
      const rpc::HookContext& context,
      const std::vector<at::Tensor>& tensors,
      std::string* metadata);
  void onReceive(
      const rpc::HookContext& context,
      std::vector<at::Tensor>& tensors,
      const std::string* metadata);
  c10::intrusive_ptr<c10::ivalue::Future> onReleaseContext(
      rpc::Request&& request);

  // The context, created if new (R2); throws for a released one (R4).
  std::shared_ptr<DistContext> join(int64_t id);
  // Removes the context and tells its peers (but `except`, `alsoExcept`
  // and lost workers); the future completes when all answered.
  c10::intrusive_ptr<c10::ivalue::Future> releaseAndForward(
      int64_t id,
      int64_t except,
      int64_t alsoExcept = -1);

  rpc::Runtime& runtime_;
  rpc::Agent& agent_;
  std::shared_ptr<DistEngine> engine_;
  ParameterVersions parameterVersions_;
  const int64_t selfId_;
  mutable std::atomic<int64_t> nextContextId_{1};
  mutable std::atomic<int64_t> nextMessageId_{1};

  mutable std::mutex mutex_;
  bool closed_ = false;
  std::unordered_map<int64_t, std::shared_ptr<DistContext>> contexts_;
  std::unordered_set<int64_t> released_;
  std::deque<int64_t> releasedOrder_;
  // Releases started here whose answers have not all come (R4).
  size_t releasesInFlight_ = 0;
  std::condition_variable releasesAnswered_;
};

} // namespace autograd
} // namespace torchrpc
