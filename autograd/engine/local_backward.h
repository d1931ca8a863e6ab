#pragma once

#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchrpc/autograd/send_recv_functions.h"

namespace torchrpc {
namespace rpc {
class Tracer;
} // namespace rpc
} // namespace torchrpc

namespace torchrpc {
namespace autograd {
namespace detail {

// One worker's part of one distributed backward pass: which of its nodes the
// pass reaches, how many gradients each still waits for, and running them.
// Knows nothing of messages: DistEngine feeds it what peers send and sends
// what it produces. See Note [Distributed backward] in
// autograd/engine/dist_engine.h; this class implements its steps D2 and E1-E4
// on one worker.
//
// Thread-safe. Nodes run on the thread that calls start(), deliver(),
// arm() or drain(), one at a time per pass (a thread that finds another
// one running the pass leaves its work queued for it); accept() only
// queues. No lock is held while a node, a hook or a callback runs.
class LocalBackward {
 public:
  // Called once per reached RecvFunction, when its gradients are complete
  // (some may be undefined: that input got none). Runs on a draining
  // thread, outside any lock.
  using RecvReady = std::function<void(
      const std::shared_ptr<RecvFunction>& recv,
      torch::autograd::variable_list grads)>;
  // Called once, when this worker's part is complete, with the gradient of
  // every leaf the pass reached (hooks applied); before done() completes.
  using LeavesReady = std::function<void(
      std::vector<std::pair<at::Tensor, at::Tensor>> leafGradients)>;

  // `tracer` (may be null) records a span per node run (Note [Tracing] in
  // rpc/tracing.h).
  LocalBackward(
      int64_t contextId,
      int64_t passId,
      std::string workerName,
      bool retainGraph,
      RecvReady recvReady,
      LeavesReady leavesReady,
      rpc::Tracer* tracer = nullptr);
  ~LocalBackward();

  int64_t passId() const {
    return passId_;
  }
  bool retainGraph() const {
    return retainGraph_;
  }
  // D2' on the driver: discovery was skipped, so the workers this pass
  // sends gradients to learn what they wait for from its Await.
  void setSkippedDiscovery() {
    skippedDiscovery_ = true;
  }
  bool skippedDiscovery() const {
    return skippedDiscovery_;
  }

  // What a walk found: RecvFunctions reached for the first time in this
  // pass, by the worker that sent their tensors (message ids).
  using NewlyReached = std::map<int64_t, std::vector<int64_t>>;

  // D2 on the driver: the roots' edges and their gradients (validated by
  // the caller; undefined ones are skipped). Delivered by start().
  NewlyReached addRoots(
      const torch::autograd::edge_list& edges,
      torch::autograd::variable_list grads);
  // D2 elsewhere: marks sends as reached (each waits for one gradient
  // message); sends already marked are ignored. Throws c10::Error if the
  // walk reaches tensors received in another context.
  NewlyReached markSends(
      const std::vector<std::shared_ptr<SendFunction>>& sends);

  // D2' (discovery skipped): the sends this worker waits for arrive with
  // the driver's Await, which may be handled after gradients for them.
  // holdDeliveries() (right after construction) makes deliver() keep
  // gradients until arm() has marked the sends, then they are delivered.
  void holdDeliveries();
  NewlyReached arm(const std::vector<std::shared_ptr<SendFunction>>& sends);

  // E1: delivers the roots' gradients and runs what becomes ready.
  void start();
  // E2: the gradients for a marked send, from its receiver. Throws
  // rpc::RpcError (kBadArguments) for an unmarked or already served send or
  // gradients that do not match what was sent; otherwise takes them and
  // returns whether something became ready to run, which drain() runs
  // (deliver() does both on the calling thread).
  bool accept(int64_t messageId, torch::autograd::variable_list grads);
  void deliver(int64_t messageId, torch::autograd::variable_list grads);
  // Runs what is ready, and what that makes ready, on the calling thread;
  // returns at once if another thread is doing so (it takes what was
  // queued). Completes the pass when nothing is left.
  void drain();
  // A gradient message this worker sent was answered (ok or not).
  void addUnacknowledged();
  void acknowledged();

  // Completes (with IValue()) once every marked send got its gradients,
  // every node that became ready ran, and every gradient message sent was
  // answered; or with the first error. Completed exactly once.
  c10::intrusive_ptr<c10::ivalue::Future> done() const {
    return done_;
  }
  // Fails the pass here (first error sticks); queued nodes do not run.
  void fail(std::exception_ptr error);

  // Marked sends still waiting for their gradients: (message id, worker).
  std::vector<std::pair<int64_t, int64_t>> waitingSends() const;

 private:
  enum class NodeKind { kInner, kSend, kRecv, kLeaf };
  struct NodeState {
    std::shared_ptr<torch::autograd::Node> node;
    NodeKind kind = NodeKind::kInner;
    // Gradients still to arrive along reached edges (and, for a send, from
    // its receiver).
    size_t dependencies = 0;
    torch::autograd::variable_list inputs;
  };
  struct ReadyNode {
    std::shared_ptr<torch::autograd::Node> node;
    torch::autograd::variable_list inputs;
  };

  // Counts the edge to `edge.function` and walks on from it if new.
  // Requires mutex_.
  void reachLocked(const torch::autograd::Edge& edge, NewlyReached& reached);
  // Adds `grad` to the input `edge` names and queues the node (or hands a
  // sink over) when it has all it waits for. Requires mutex_.
  void routeLocked(const torch::autograd::Edge& edge, at::Tensor grad);
  void maybeCompleteLocked(std::unique_lock<std::mutex>& lock);
  torch::autograd::variable_list runNode(
      torch::autograd::Node& node,
      torch::autograd::variable_list inputs);

  const int64_t contextId_;
  const int64_t passId_;
  const std::string workerName_;
  const bool retainGraph_;
  const RecvReady recvReady_;
  const LeavesReady leavesReady_;
  rpc::Tracer* const tracer_;
  const c10::intrusive_ptr<c10::ivalue::Future> done_;
  std::atomic<bool> skippedDiscovery_{false};

  mutable std::mutex mutex_;
  std::unordered_map<torch::autograd::Node*, NodeState> nodes_;
  std::map<int64_t, std::shared_ptr<SendFunction>> marked_;
  torch::autograd::edge_list rootEdges_;
  torch::autograd::variable_list rootGrads_;
  bool isDriver_ = false;
  bool started_ = false;
  bool holding_ = false; // D2': until arm()
  std::vector<std::pair<int64_t, torch::autograd::variable_list>> held_;
  size_t waitingEntries_ = 0; // marked sends without gradients, roots
  size_t unacknowledged_ = 0;
  std::deque<ReadyNode> ready_;
  std::vector<
      std::pair<std::shared_ptr<RecvFunction>, torch::autograd::variable_list>>
      readyRecvs_;
  std::vector<std::pair<std::shared_ptr<torch::autograd::Node>, at::Tensor>>
      leaves_;
  bool draining_ = false;
  bool finished_ = false;
  std::exception_ptr error_;
};

} // namespace detail
} // namespace autograd
} // namespace torchrpc
