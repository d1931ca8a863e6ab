#include "autograd/send_recv_functions.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/utils.h>

namespace torchrpc {
namespace autograd {

namespace {

std::vector<at::Tensor> requiringGrad(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const auto& tensor : tensors) {
    if (tensor.defined() && tensor.requires_grad()) {
      out.push_back(tensor);
    }
  }
  return out;
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
    int64_t fromWorker)
    : contextId_(contextId),
      messageId_(messageId),
      fromWorker_(fromWorker) {}

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
