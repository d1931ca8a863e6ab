#pragma once

#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torchrpc {
namespace autograd {

// The two ends of a message that carried tensors requiring grad inside a
// distributed autograd context; both are nodes of libtorch's own graph. See
// Note [Distributed autograd recording] in autograd/context_container.h.

// On the sender: its next edges are the gradient edges of the tensors sent
// (in wire order, those requiring grad); its inputs are the gradients the
// receiver sends back. Applying it passes them on unchanged.
class SendFunction : public torch::autograd::Node {
 public:
  SendFunction(
      int64_t contextId,
      int64_t messageId,
      int64_t toWorker,
      const std::vector<at::Tensor>& tensors);

  torch::autograd::variable_list apply(
      torch::autograd::variable_list&& grads) override;
  std::string name() const override;

  int64_t contextId() const {
    return contextId_;
  }
  int64_t messageId() const {
    return messageId_;
  }
  int64_t toWorker() const {
    return toWorker_;
  }

  // What was sent as input `index` (gradients coming back must match it).
  struct Sent {
    std::vector<int64_t> sizes;
    at::TensorOptions options;
  };
  const std::vector<Sent>& sent() const {
    return sent_;
  }

  // Whether the graph behind the sent tensors reaches no RecvFunction, so
  // a backward pass that reaches this send reaches no further worker from
  // here. Fixed at construction: nodes only point to older nodes. True
  // without a walk while no RecvFunction exists in the process; otherwise
  // false (unknown) for graphs larger than kMaxFinalityWalk nodes.
  bool graphIsFinal() const {
    return graphIsFinal_;
  }
  static constexpr size_t kMaxFinalityWalk = 4096;

 private:
  const int64_t contextId_;
  const int64_t messageId_;
  const int64_t toWorker_;
  std::vector<Sent> sent_;
  bool graphIsFinal_ = false;
};

// On the receiver: the grad_fn of the received tensors that require grad.
// Their gradients go back to the sender's SendFunction; the distributed
// backward captures them there and never applies this node, so a local
// backward() that reaches it fails with an error saying so.
class RecvFunction : public torch::autograd::Node {
 public:
  // senderGraphIsFinal: the sender said its SendFunction's graphIsFinal().
  RecvFunction(
      int64_t contextId,
      int64_t messageId,
      int64_t fromWorker,
      bool senderGraphIsFinal);
  ~RecvFunction() override;

  // Makes this node the grad_fn of `tensors` (those requiring grad, in
  // order).
  void adopt(std::vector<at::Tensor>& tensors);

  torch::autograd::variable_list apply(
      torch::autograd::variable_list&& grads) override;
  std::string name() const override;

  int64_t contextId() const {
    return contextId_;
  }
  int64_t messageId() const {
    return messageId_;
  }
  int64_t fromWorker() const {
    return fromWorker_;
  }
  bool senderGraphIsFinal() const {
    return senderGraphIsFinal_;
  }
  // RecvFunctions alive in this process: what SendFunction's constructor
  // reads to skip its walk; exposed for tests.
  static int64_t liveCount();

 private:
  const int64_t contextId_;
  const int64_t messageId_;
  const int64_t fromWorker_;
  const bool senderGraphIsFinal_;
};

} // namespace autograd
} // namespace torchrpc
