#include "torchrpc/optim/detail/flat_optimizer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cstring>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

namespace torchrpc {
namespace optim {
namespace detail {

namespace {

using ParamState = torch::optim::OptimizerParamState;
using StateMap =
    std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>;

// libtorch keys an optimizer's state by the parameter's TensorImpl: its
// address as a string in 1.x, the address itself in 2.x.
template <typename Key = StateMap::key_type>
Key stateKey(const at::Tensor& parameter) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream key;
    key << parameter.unsafeGetTensorImpl();
    return key.str();
  } else {
    return static_cast<Key>(parameter.unsafeGetTensorImpl());
  }
}

// One parameter's state as the tensors it holds (one element per parameter:
// moments, sums, buffers) and its step count (null for SGD, which has none).
struct StateFields {
  std::vector<at::Tensor*> tensors;
  int64_t* step = nullptr;
};

StateFields fieldsOf(ParamState& state) {
  if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(&state)) {
    return {
        {&adam->exp_avg(), &adam->exp_avg_sq(), &adam->max_exp_avg_sq()},
        &adam->step()};
  }
  if (auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(&state)) {
    return {
        {&adamw->exp_avg(), &adamw->exp_avg_sq(), &adamw->max_exp_avg_sq()},
        &adamw->step()};
  }
  if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(&state)) {
    return {{&sgd->momentum_buffer()}, nullptr};
  }
  if (auto* adagrad = dynamic_cast<torch::optim::AdagradParamState*>(&state)) {
    return {{&adagrad->sum()}, &adagrad->step()};
  }
  if (auto* rms = dynamic_cast<torch::optim::RMSpropParamState*>(&state)) {
    return {
        {&rms->square_avg(), &rms->momentum_buffer(), &rms->grad_avg()},
        &rms->step()};
  }
  TORCH_INTERNAL_ASSERT(false, "an optimizer state of unknown type");
}

// Whether two parameters' states can be one: same step count, the same
// tensors present.
bool sameShape(StateFields a, StateFields b) {
  if ((a.step == nullptr) != (b.step == nullptr) ||
      (a.step != nullptr && *a.step != *b.step)) {
    return false;
  }
  for (size_t k = 0; k < a.tensors.size(); ++k) {
    if (a.tensors[k]->defined() != b.tensors[k]->defined()) {
      return false;
    }
  }
  return true;
}

bool contiguousOnCpu(const at::Tensor& tensor) {
  return tensor.device().is_cpu() && tensor.is_contiguous();
}

// Concatenates `parts` into `flat` (same dtype). A memcpy per part when it
// can: at::cat_out's dispatch costs ~2 us a part, ten times the copy of a
// 4 KiB parameter's gradient.
void gatherInto(at::Tensor& flat, const std::vector<at::Tensor>& parts) {
  bool copyable = contiguousOnCpu(flat);
  for (const auto& part : parts) {
    copyable = copyable && contiguousOnCpu(part);
  }
  if (!copyable) {
    std::vector<at::Tensor> flatParts;
    flatParts.reserve(parts.size());
    for (const auto& part : parts) {
      flatParts.push_back(part.reshape({-1}));
    }
    at::cat_out(flat, flatParts, 0);
    return;
  }
  auto* out = static_cast<char*>(flat.data_ptr());
  for (const auto& part : parts) {
    size_t bytes = part.numel() * part.element_size();
    if (bytes > 0) {
      std::memcpy(out, part.data_ptr(), bytes);
      out += bytes;
    }
  }
}

} // namespace

at::Tensor FlatOptimizer::copyOf(size_t i) const {
  const at::Tensor& value = parameters_.at(i);
  if (!contiguousOnCpu(value)) {
    return value.detach().clone();
  }
  // As gatherInto: clone() dispatches twice (empty, copy_) per parameter.
  at::Tensor copy = at::empty(value.sizes(), value.options());
  size_t bytes = value.numel() * value.element_size();
  if (bytes > 0) {
    std::memcpy(copy.data_ptr(), value.data_ptr(), bytes);
  }
  return copy;
}

FlatOptimizer::FlatOptimizer(
    const OptimizerOptions& options,
    const std::vector<at::Tensor>& initial) {
  TORCH_CHECK(!initial.empty(), "an optimizer needs parameters");
  at::NoGradGuard noGrad;
  bool shareable = true;
  int64_t total = 0;
  for (const auto& value : initial) {
    shareable = shareable &&
        value.scalar_type() == initial.front().scalar_type() &&
        value.device() == initial.front().device() &&
        value.layout() == at::kStrided;
    total += value.numel();
  }
  for (const auto& value : initial) {
    parameters_.push_back(value.detach().clone());
  }
  perParameter_ = options.make(parameters_);
  if (shareable) {
    flat_ = at::empty({total}, initial.front().options());
    flatGradient_ = at::empty_like(flat_);
    int64_t offset = 0;
    for (const auto& value : initial) {
      views_.push_back(
          flat_.narrow(0, offset, value.numel()).view(value.sizes()));
      offset += value.numel();
    }
    whole_ = options.make({flat_});
    // Optimizers that make state up front (Adagrad) made it for the buffer
    // too; the per-parameter optimizer holds it until the first flat step.
    whole_->state().clear();
  }
}

bool FlatOptimizer::canStepFlat(
    const std::vector<at::Tensor>& gradients) const {
  if (!whole_) {
    return false;
  }
  for (size_t i = 0; i < gradients.size(); ++i) {
    const at::Tensor& gradient = gradients[i];
    if (!gradient.defined() || gradient.layout() != at::kStrided ||
        gradient.scalar_type() != flat_.scalar_type() ||
        gradient.device() != flat_.device() ||
        !gradient.sizes().equals(parameters_[i].sizes())) {
      return false;
    }
  }
  return true;
}

int64_t FlatOptimizer::step(const std::vector<at::Tensor>& gradients) {
  TORCH_CHECK(
      gradients.size() == parameters_.size(),
      "a step takes one gradient per parameter (",
      parameters_.size(),
      "), got ",
      gradients.size());
  bool anyGradient = false;
  for (const auto& gradient : gradients) {
    anyGradient = anyGradient || gradient.defined();
  }
  if (!anyGradient) {
    return 0;
  }
  at::NoGradGuard noGrad;
  if (canStepFlat(gradients) && (fused_ || toFlat())) {
    gatherInto(flatGradient_, gradients);
    // The per-parameter optimizer's options are the ones set and loaded.
    whole_->param_groups().front().set_options(
        perParameter_->param_groups().front().options().clone());
    flat_.mutable_grad() = flatGradient_;
    whole_->step();
    flat_.mutable_grad() = at::Tensor();
    return static_cast<int64_t>(gradients.size());
  }
  toPerParameter();
  int64_t stepped = 0;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    parameters_[i].mutable_grad() = gradients[i];
    stepped += gradients[i].defined() ? 1 : 0;
  }
  perParameter_->step();
  for (auto& parameter : parameters_) {
    parameter.mutable_grad() = at::Tensor();
  }
  return stepped;
}

bool FlatOptimizer::toFlat() {
  if (fused_) {
    return true;
  }
  auto& states = perParameter_->state();
  std::vector<ParamState*> found;
  for (const auto& parameter : parameters_) {
    auto it = states.find(stateKey(parameter));
    found.push_back(it == states.end() ? nullptr : it->second.get());
  }
  bool any = false;
  bool all = true;
  for (ParamState* state : found) {
    any = any || state != nullptr;
    all = all && state != nullptr;
  }
  if (any && !all) {
    return false;
  }
  if (all) {
    StateFields first = fieldsOf(*found.front());
    for (ParamState* state : found) {
      if (!sameShape(first, fieldsOf(*state))) {
        return false;
      }
    }
    auto joined = found.front()->clone();
    StateFields target = fieldsOf(*joined);
    for (size_t k = 0; k < target.tensors.size(); ++k) {
      if (!target.tensors[k]->defined()) {
        continue;
      }
      std::vector<at::Tensor> parts;
      parts.reserve(found.size());
      for (ParamState* state : found) {
        parts.push_back(fieldsOf(*state).tensors[k]->reshape({-1}));
      }
      *target.tensors[k] = at::cat(parts);
    }
    whole_->state()[stateKey(flat_)] = std::move(joined);
  }
  for (size_t i = 0; i < parameters_.size(); ++i) {
    states.erase(stateKey(parameters_[i]));
    views_[i].copy_(parameters_[i]);
  }
  parameters_ = views_;
  fused_ = true;
  return true;
}

void FlatOptimizer::toPerParameter() {
  if (!fused_) {
    return;
  }
  // Each parameter gets its own tensor again: libtorch's sparse updates
  // (SGD's, Adagrad's add_ of a sparse gradient) ignore a view's offset into
  // its buffer.
  std::vector<at::Tensor> standalone;
  for (const auto& view : views_) {
    standalone.push_back(view.clone());
  }
  auto& wholeStates = whole_->state();
  auto it = wholeStates.find(stateKey(flat_));
  if (it != wholeStates.end()) {
    StateFields source = fieldsOf(*it->second);
    int64_t offset = 0;
    for (const auto& parameter : standalone) {
      auto state = it->second->clone();
      StateFields target = fieldsOf(*state);
      for (size_t k = 0; k < target.tensors.size(); ++k) {
        if (source.tensors[k]->defined()) {
          *target.tensors[k] = source.tensors[k]
                                   ->narrow(0, offset, parameter.numel())
                                   .view(parameter.sizes())
                                   .clone();
        }
      }
      perParameter_->state()[stateKey(parameter)] = std::move(state);
      offset += parameter.numel();
    }
    wholeStates.erase(it);
  }
  perParameter_->param_groups().front().params() = standalone;
  parameters_ = std::move(standalone);
  fused_ = false;
}

double FlatOptimizer::learningRate() const {
  return perParameter_->param_groups().front().options().get_lr();
}

void FlatOptimizer::setLearningRate(double lr) {
  for (auto& group : perParameter_->param_groups()) {
    group.options().set_lr(lr);
  }
}

void FlatOptimizer::save(torch::serialize::OutputArchive& archive) {
  toPerParameter();
  perParameter_->save(archive);
}

void FlatOptimizer::load(torch::serialize::InputArchive& archive) {
  toPerParameter();
  perParameter_->load(archive);
}

} // namespace detail
} // namespace optim
} // namespace torchrpc
