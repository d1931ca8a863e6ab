#include "torchrpc/autograd/send_recv_functions.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <atomic>
#include <unordered_set>

namespace torchrpc {
namespace autograd {

namespace {

// RecvFunctions alive in this process: while there are none, no graph
// reaches one, and a SendFunction needs no walk to know that its graph is
// final. Per process, not per runtime, on purpose: a tensor one runtime
// received may be computed with and sent by another in the same process.
// A RecvFunction counts for as long as anything holds it, graph edges
// included, and is counted before it becomes any tensor's grad_fn, so a
// thread that holds a tensor whose graph reaches it sees the count.
std::atomic<int64_t> liveRecvFunctions{0};

std::vector<at::Tensor> requiringGrad(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const auto& tensor : tensors) {
    if (tensor.defined() && tensor.requires_grad()) {
      out.push_back(tensor);
    }
  }
  return out;
}

// Whether no RecvFunction is reachable from `edges`; false also when the
// walk would visit more than `limit` nodes.
bool reachesNoRecv(const torch::autograd::edge_list& edges, size_t limit) {
  std::unordered_set<torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> toWalk;
  auto visit = [&](const torch::autograd::Edge& edge) {
    if (edge.is_valid() && seen.insert(edge.function.get()).second) {
      toWalk.push_back(edge.function.get());
    }
  };
  for (const auto& edge : edges) {
    visit(edge);
  }
  while (!toWalk.empty()) {
    if (seen.size() > limit) {
      return false;
    }
    torch::autograd::Node* node = toWalk.back();
    toWalk.pop_back();
    if (dynamic_cast<RecvFunction*>(node) != nullptr) {
      return false;
    }
    for (const auto& edge : node->next_edges()) {
      visit(edge);
    }
  }
  return true;
}

} // namespace

SendFunction::SendFunction(
    int64_t contextId,
    int64_t messageId,
    int64_t toWorker,
    const std::vector<at::Tensor>& tensors)
    : contextId_(contextId),
      messageId_(messageId),
      toWorker_(toWorker) {
  auto sent = requiringGrad(tensors);
  set_next_edges(torch::autograd::collect_next_edges(sent));
  for (const auto& tensor : sent) {
    add_input_metadata(tensor);
    sent_.push_back(Sent{tensor.sizes().vec(), tensor.options()});
  }
  // A server whose callers send it no tensor that requires grad (data,
  // not activations) holds none: its replies then skip the walk, whose
  // cost grows with the model behind them.
  graphIsFinal_ = liveRecvFunctions.load() == 0 ||
      reachesNoRecv(next_edges(), kMaxFinalityWalk);
}

torch::autograd::variable_list SendFunction::apply(
    torch::autograd::variable_list&& grads) {
  return std::move(grads);
}

std::string SendFunction::name() const {
  return "torchrpc::autograd::SendFunction";
}

RecvFunction::RecvFunction(
    int64_t contextId,
    int64_t messageId,
    int64_t fromWorker,
    bool senderGraphIsFinal)
    : contextId_(contextId),
      messageId_(messageId),
      fromWorker_(fromWorker),
      senderGraphIsFinal_(senderGraphIsFinal) {
  liveRecvFunctions.fetch_add(1);
}

RecvFunction::~RecvFunction() {
  liveRecvFunctions.fetch_sub(1);
}

int64_t RecvFunction::liveCount() {
  return liveRecvFunctions.load();
}

void RecvFunction::adopt(std::vector<at::Tensor>& tensors) {
  auto self = shared_from_this();
  for (auto& tensor : tensors) {
    if (tensor.defined() && tensor.requires_grad()) {
      torch::autograd::set_history(tensor, self);
    }
  }
}

torch::autograd::variable_list RecvFunction::apply(
    torch::autograd::variable_list&& /*grads*/) {
  TORCH_CHECK(
      false,
      "a local backward() reached tensors received from worker ",
      fromWorker_,
      " in distributed autograd context ",
      contextId_,
      "; run the distributed backward of torchrpc::autograd instead");
}

std::string RecvFunction::name() const {
  return "torchrpc::autograd::RecvFunction";
}

} // namespace autograd
} // namespace torchrpc
