#include "torchrpc/autograd/engine/local_backward.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/input_metadata.h>
#include <torch/version.h>

#include <optional>
#include <sstream>

#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/tracing.h"

namespace torchrpc {
namespace autograd {
namespace detail {

using torch::autograd::AccumulateGrad;
using torch::autograd::Edge;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// The hooks libtorch's engine runs before a node, in its order.
variable_list callPreHooks(Node& node, variable_list inputs) {
#if TORCH_VERSION_MAJOR >= 2
  for (const auto& hook : node.tensor_pre_hooks()) {
    inputs = (*hook)(inputs);
  }
  for (const auto& entry : node.retains_grad_hooks()) {
    inputs = (*entry.second)(inputs);
  }
#endif
  for (const auto& hook : node.pre_hooks()) {
    inputs = (*hook)(inputs);
  }
  return inputs;
}

// Sums gradients out of place: a gradient may be shared by several edges.
// sparse + sparse stays sparse; with a dense one the sum is dense, and the
// dense operand goes first (libtorch's CPU add refuses sparse + dense).
at::Tensor accumulate(const at::Tensor& sum, at::Tensor grad) {
  if (!sum.defined()) {
    return grad;
  }
  if (!grad.defined()) {
    return sum;
  }
  if (sum.is_sparse() && !grad.is_sparse()) {
    return grad + sum;
  }
  return sum + grad;
}

std::string describeSizes(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << sizes;
  return out.str();
}

// What libtorch's engine does to a node's outputs before passing them on:
// reduce a gradient that was broadcast in the forward (a bias added to a
// batch) to its input's shape, and match the input's dtype and device.
void validateOutputs(const Node& node, variable_list& grads) {
  const auto& edges = node.next_edges();
  TORCH_CHECK(
      grads.size() == edges.size(),
      node.name(),
      " returned ",
      grads.size(),
      " gradients for ",
      edges.size(),
      " inputs");
  for (size_t i = 0; i < grads.size(); ++i) {
    const Edge& edge = edges[i];
    at::Tensor& grad = grads[i];
    if (!edge.is_valid() || !grad.defined()) {
      continue;
    }
    const auto& metadata = edge.function->input_metadata(edge.input_nr);
    if (!metadata.is_same_shape(grad)) {
      TORCH_CHECK(
          metadata.is_expandable_to_shape(grad),
          node.name(),
          ": ",
          metadata.incompatible_shape_error_message(i, grad).str());
      grad = metadata.reduce_grad(grad);
    }
    auto dtype = c10::typeMetaToScalarType(metadata.dtype());
    if (grad.scalar_type() != dtype) {
      grad = grad.to(dtype);
    }
    if (grad.device() != metadata.device()) {
      grad = grad.to(metadata.device());
    }
  }
}

} // namespace

LocalBackward::LocalBackward(
    int64_t contextId,
    int64_t passId,
    std::string workerName,
    bool retainGraph,
    RecvReady recvReady,
    LeavesReady leavesReady,
    rpc::Tracer* tracer)
    : contextId_(contextId),
      passId_(passId),
      workerName_(std::move(workerName)),
      retainGraph_(retainGraph),
      recvReady_(std::move(recvReady)),
      leavesReady_(std::move(leavesReady)),
      tracer_(tracer),
      done_(c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get())) {}

LocalBackward::~LocalBackward() {
  if (!done_->completed()) {
    done_->setError(rpc::makeRpcError(
        rpc::ErrorCode::kShuttingDown,
        workerName_,
        "autograd.backward",
        0,
        "the distributed autograd context was released during the pass"));
  }
}

// ---- D2: what the pass reaches ---------------------------------------------

void LocalBackward::reachLocked(const Edge& first, NewlyReached& reached) {
  std::vector<Node*> toWalk;
  auto count = [&](const Edge& edge) {
    if (!edge.is_valid()) {
      return;
    }
    auto inserted = nodes_.try_emplace(edge.function.get());
    NodeState& state = inserted.first->second;
    ++state.dependencies;
    if (!inserted.second) {
      return;
    }
    state.node = edge.function;
    state.inputs.resize(edge.function->num_inputs());
    if (auto* recv = dynamic_cast<RecvFunction*>(edge.function.get())) {
      TORCH_CHECK(
          recv->contextId() == contextId_,
          "the backward pass of distributed autograd context ",
          contextId_,
          " reaches tensors received in context ",
          recv->contextId(),
          "; gradients cannot cross contexts");
      state.kind = NodeKind::kRecv;
      reached[recv->fromWorker()].push_back(recv->messageId());
    } else if (dynamic_cast<AccumulateGrad*>(edge.function.get())) {
      state.kind = NodeKind::kLeaf;
    } else {
      toWalk.push_back(edge.function.get());
    }
  };
  count(first);
  while (!toWalk.empty()) {
    Node* node = toWalk.back();
    toWalk.pop_back();
    for (const Edge& edge : node->next_edges()) {
      count(edge);
    }
  }
}

LocalBackward::NewlyReached LocalBackward::addRoots(
    const torch::autograd::edge_list& edges,
    variable_list grads) {
  TORCH_INTERNAL_ASSERT(edges.size() == grads.size());
  NewlyReached reached;
  std::lock_guard<std::mutex> guard(mutex_);
  TORCH_INTERNAL_ASSERT(!isDriver_, "roots added twice");
  isDriver_ = true;
  ++waitingEntries_; // the roots, delivered by start()
  for (size_t i = 0; i < edges.size(); ++i) {
    if (edges[i].is_valid() && grads[i].defined()) {
      reachLocked(edges[i], reached);
      rootEdges_.push_back(edges[i]);
      rootGrads_.push_back(std::move(grads[i]));
    }
  }
  return reached;
}

LocalBackward::NewlyReached LocalBackward::markSends(
    const std::vector<std::shared_ptr<SendFunction>>& sends) {
  NewlyReached reached;
  std::lock_guard<std::mutex> guard(mutex_);
  for (const auto& send : sends) {
    if (!marked_.emplace(send->messageId(), send).second) {
      continue;
    }
    NodeState& state = nodes_[send.get()];
    state.node = send;
    state.kind = NodeKind::kSend;
    state.dependencies = 1; // the gradient message from its receiver
    state.inputs.resize(send->num_inputs());
    ++waitingEntries_;
    for (const Edge& edge : send->next_edges()) {
      reachLocked(edge, reached);
    }
  }
  return reached;
}

void LocalBackward::holdDeliveries() {
  std::lock_guard<std::mutex> guard(mutex_);
  holding_ = true;
}

LocalBackward::NewlyReached LocalBackward::arm(
    const std::vector<std::shared_ptr<SendFunction>>& sends) {
  NewlyReached reached = markSends(sends);
  std::vector<std::pair<int64_t, variable_list>> held;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    holding_ = false;
    held.swap(held_);
  }
  for (auto& entry : held) {
    try {
      deliver(entry.first, std::move(entry.second));
    } catch (...) {
      fail(std::current_exception());
    }
  }
  // Nothing held and nothing marked completes here.
  std::unique_lock<std::mutex> lock(mutex_);
  maybeCompleteLocked(lock);
  return reached;
}

// ---- E1-E4: running it
// -------------------------------------------------------

void LocalBackward::start() {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    TORCH_INTERNAL_ASSERT(isDriver_ && !started_);
    started_ = true;
    for (size_t i = 0; i < rootEdges_.size(); ++i) {
      routeLocked(rootEdges_[i], std::move(rootGrads_[i]));
    }
    rootEdges_.clear();
    rootGrads_.clear();
    --waitingEntries_;
  }
  drain();
}

void LocalBackward::deliver(int64_t messageId, variable_list grads) {
  if (accept(messageId, std::move(grads))) {
    drain();
  }
}

bool LocalBackward::accept(int64_t messageId, variable_list grads) {
  auto refuse = [&](const std::string& why) {
    throw rpc::RpcError(
        rpc::ErrorCode::kBadArguments,
        workerName_,
        "autograd.backward",
        0,
        "gradients for send #" + std::to_string(messageId) +
            " of distributed autograd context " + std::to_string(contextId_) +
            " refused: " + why);
  };
  {
    std::lock_guard<std::mutex> guard(mutex_);
    if (holding_) {
      held_.emplace_back(messageId, std::move(grads));
      return false;
    }
    auto it = marked_.find(messageId);
    if (it == marked_.end()) {
      refuse("this pass does not wait for them");
    }
    const auto& send = it->second;
    NodeState& state = nodes_.at(send.get());
    if (state.dependencies == 0) {
      refuse("they arrived twice");
    }
    const auto& sent = send->sent();
    if (grads.size() != sent.size()) {
      refuse(
          std::to_string(grads.size()) + " gradients for " +
          std::to_string(sent.size()) + " tensors");
    }
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) {
        continue;
      }
      if (grads[i].sizes() != at::IntArrayRef(sent[i].sizes) ||
          grads[i].scalar_type() !=
              c10::typeMetaToScalarType(sent[i].options.dtype())) {
        refuse(
            "gradient " + std::to_string(i) + " is " +
            std::string(c10::toString(grads[i].scalar_type())) +
            describeSizes(grads[i].sizes()) + ", the tensor sent was " +
            std::string(c10::toString(
                c10::typeMetaToScalarType(sent[i].options.dtype()))) +
            describeSizes(sent[i].sizes));
      }
      if (grads[i].device() != sent[i].options.device()) {
        grads[i] = grads[i].to(sent[i].options.device());
      }
    }
    state.inputs = std::move(grads);
    state.dependencies = 0;
    --waitingEntries_;
    if (error_) {
      return false;
    }
    ready_.push_back(ReadyNode{state.node, std::move(state.inputs)});
  }
  return true;
}

void LocalBackward::routeLocked(const Edge& edge, at::Tensor grad) {
  if (!edge.is_valid()) {
    return;
  }
  auto it = nodes_.find(edge.function.get());
  TORCH_INTERNAL_ASSERT(
      it != nodes_.end() && it->second.dependencies > 0,
      "distributed backward reached a node its walk did not count");
  NodeState& state = it->second;
  auto& slot = state.inputs.at(edge.input_nr);
  slot = accumulate(slot, std::move(grad));
  if (--state.dependencies > 0) {
    return;
  }
  switch (state.kind) {
    case NodeKind::kRecv:
      readyRecvs_.emplace_back(
          std::static_pointer_cast<RecvFunction>(state.node),
          std::move(state.inputs));
      break;
    case NodeKind::kLeaf:
      leaves_.emplace_back(state.node, std::move(state.inputs.at(0)));
      break;
    case NodeKind::kInner:
    case NodeKind::kSend:
      ready_.push_back(ReadyNode{state.node, std::move(state.inputs)});
      break;
  }
}

variable_list LocalBackward::runNode(Node& node, variable_list inputs) {
  std::optional<rpc::TraceSpan> span;
  if (tracer_ != nullptr && tracer_->enabled()) {
    span.emplace(*tracer_, "autograd");
    span->name(node.name());
    span->arg("context", contextId_);
    span->arg("pass", passId_);
  }
  // As libtorch's engine does when create_graph is false.
  at::AutoGradMode gradMode(false);
  inputs = callPreHooks(node, std::move(inputs));
  if (!retainGraph_) {
    node.will_release_variables();
  }
  bool hasPostHooks = !node.post_hooks().empty();
  variable_list outputs =
      hasPostHooks ? node(variable_list(inputs)) : node(std::move(inputs));
  if (!retainGraph_) {
    node.release_variables();
  }
  for (const auto& hook : node.post_hooks()) {
    outputs = (*hook)(outputs, inputs);
  }
  validateOutputs(node, outputs);
  return outputs;
}

void LocalBackward::drain() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (draining_) {
    return; // the running thread takes what was queued
  }
  draining_ = true;
  while (!error_ && (!ready_.empty() || !readyRecvs_.empty())) {
    if (!readyRecvs_.empty()) {
      auto recvs = std::move(readyRecvs_);
      readyRecvs_.clear();
      lock.unlock();
      // A recv whose gradients cannot be sent fails the pass, as a node
      // that throws does; thrown on, it would leave the pass draining and
      // unable to complete until its deadline.
      std::exception_ptr error;
      for (auto& entry : recvs) {
        try {
          recvReady_(entry.first, std::move(entry.second));
        } catch (...) {
          error = rpc::makeRpcError(
              rpc::ErrorCode::kInternal,
              workerName_,
              "autograd.backward",
              0,
              "sending the gradients of recv #" +
                  std::to_string(entry.first->messageId()) + " failed: " +
                  rpc::describeException(std::current_exception()));
          break;
        }
      }
      lock.lock();
      if (error) {
        if (!error_) {
          error_ = error;
        }
        break;
      }
      continue;
    }
    ReadyNode task = std::move(ready_.front());
    ready_.pop_front();
    lock.unlock();
    variable_list outputs;
    std::exception_ptr error;
    try {
      outputs = runNode(*task.node, std::move(task.inputs));
    } catch (...) {
      // Whatever a node throws (user code: hooks, custom functions) fails
      // the pass; thrown on, it would leave the pass draining for good.
      error = rpc::makeRpcError(
          rpc::ErrorCode::kRemoteException,
          workerName_,
          "autograd.backward",
          0,
          task.node->name() +
              " raised: " + rpc::describeException(std::current_exception()));
    }
    lock.lock();
    if (error) {
      if (!error_) {
        error_ = error;
      }
      break;
    }
    try {
      const auto& edges = task.node->next_edges();
      for (size_t i = 0; i < edges.size(); ++i) {
        routeLocked(edges[i], std::move(outputs[i]));
      }
    } catch (const std::exception& e) {
      error_ = rpc::makeRpcError(
          rpc::ErrorCode::kInternal,
          workerName_,
          "autograd.backward",
          0,
          std::string("routing the gradients of ") + task.node->name() +
              " failed: " + rpc::describeException(e));
      break;
    }
  }
  draining_ = false;
  maybeCompleteLocked(lock);
}

void LocalBackward::addUnacknowledged() {
  std::lock_guard<std::mutex> guard(mutex_);
  ++unacknowledged_;
}

void LocalBackward::acknowledged() {
  std::unique_lock<std::mutex> lock(mutex_);
  --unacknowledged_;
  maybeCompleteLocked(lock);
}

void LocalBackward::fail(std::exception_ptr error) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!error_) {
    error_ = std::move(error);
  }
  maybeCompleteLocked(lock);
}

void LocalBackward::maybeCompleteLocked(std::unique_lock<std::mutex>& lock) {
  if (finished_ || draining_) {
    return;
  }
  if (error_) {
    finished_ = true;
    auto error = error_;
    ready_.clear();
    lock.unlock();
    done_->setError(error);
    return;
  }
  if (waitingEntries_ > 0 || (isDriver_ && !started_) || holding_ ||
      unacknowledged_ > 0 || !ready_.empty() || !readyRecvs_.empty()) {
    return;
  }
  finished_ = true;
  auto leaves = std::move(leaves_);
  leaves_.clear();
  lock.unlock();
  // Leaf hooks run once, on the leaf's whole gradient of this pass, as
  // libtorch's engine runs an AccumulateGrad node: pre-hooks and the
  // tensor's hooks on the gradient, the accumulation, then post-hooks with
  // (no outputs, the gradient).
  std::vector<std::pair<at::Tensor, at::Tensor>> gradients;
  // Leaves with post-hooks, and the gradient each hook is shown. Holding it
  // makes the context copy that gradient (Note [Gradient ownership]); only
  // those leaves pay for it.
  std::vector<std::pair<AccumulateGrad*, variable_list>> postHooked;
  try {
    at::AutoGradMode gradMode(false);
    for (auto& leaf : leaves) {
      if (!leaf.second.defined()) {
        continue;
      }
      auto& accumulator = static_cast<AccumulateGrad&>(*leaf.first);
      variable_list grad =
          callPreHooks(accumulator, variable_list{std::move(leaf.second)});
      // libtorch shows post-hooks the node's input: in 1.x the tensor's
      // hooks run inside AccumulateGrad::apply, after that input is taken;
      // in 2.x they are pre-hooks and already ran.
      if (!accumulator.post_hooks().empty()) {
        postHooked.emplace_back(&accumulator, grad);
      }
#if TORCH_VERSION_MAJOR < 2
      grad[0] = AccumulateGrad::callHooks(accumulator.variable, grad[0]);
#endif
      if (grad[0].defined()) {
        gradients.emplace_back(accumulator.variable, std::move(grad[0]));
      }
    }
    leavesReady_(std::move(gradients));
    const variable_list noOutputs;
    for (auto& entry : postHooked) {
      for (const auto& hook : entry.first->post_hooks()) {
        (*hook)(noOutputs, entry.second);
      }
    }
  } catch (const std::exception& e) {
    done_->setError(rpc::makeRpcError(
        rpc::ErrorCode::kRemoteException,
        workerName_,
        "autograd.backward",
        0,
        std::string("a leaf's gradient hook raised: ") +
            rpc::describeException(e)));
    return;
  }
  done_->markCompleted(c10::IValue());
}

std::vector<std::pair<int64_t, int64_t>> LocalBackward::waitingSends() const {
  std::lock_guard<std::mutex> guard(mutex_);
  std::vector<std::pair<int64_t, int64_t>> waiting;
  for (const auto& entry : marked_) {
    auto it = nodes_.find(entry.second.get());
    if (it != nodes_.end() && it->second.dependencies > 0) {
      waiting.emplace_back(entry.first, entry.second->toWorker());
    }
  }
  return waiting;
}

} // namespace detail
} // namespace autograd
} // namespace torchrpc
