#include "torchrpc/autograd/parameter_versions.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace torchrpc {
namespace autograd {

int64_t ParameterVersions::slotOf(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.defined(), "a parameter must be a defined tensor");
  std::lock_guard<std::mutex> guard(mutex_);
  int64_t slot = findLocked(tensor);
  if (slot < 0) {
    slot = nextSlot_++;
    addLocked(slot, tensor);
  }
  return slot;
}

int64_t ParameterVersions::find(const at::Tensor& tensor) const {
  std::lock_guard<std::mutex> guard(mutex_);
  return findLocked(tensor);
}

void ParameterVersions::add(int64_t slot, const at::Tensor& version) {
  TORCH_CHECK(version.defined(), "a parameter version must be defined");
  std::lock_guard<std::mutex> guard(mutex_);
  TORCH_CHECK(
      slot >= 0 && slot < nextSlot_,
      "no parameter slot ",
      slot,
      " here");
  addLocked(slot, version);
}

std::unordered_map<int64_t, at::Tensor> ParameterVersions::bySlot(
    const c10::Dict<at::Tensor, at::Tensor>& gradients) const {
  std::unordered_map<int64_t, at::Tensor> out;
  std::lock_guard<std::mutex> guard(mutex_);
  for (const auto& entry : gradients) {
    int64_t slot = findLocked(entry.key());
    if (slot < 0) {
      continue;
    }
    auto it = out.find(slot);
    if (it == out.end()) {
      out.emplace(slot, entry.value());
    } else {
      // A context whose forwards used two versions of one parameter: both
      // gradients count, out of place (the context's are read-only).
      it->second = it->second.add(entry.value());
    }
  }
  return out;
}

size_t ParameterVersions::size() const {
  std::lock_guard<std::mutex> guard(mutex_);
  size_t live = 0;
  for (const auto& entry : versions_) {
    live += entry.second.version.expired() ? 0 : 1;
  }
  return live;
}

int64_t ParameterVersions::findLocked(const at::Tensor& tensor) const {
  auto it = versions_.find(tensor.unsafeGetTensorImpl());
  if (it == versions_.end() || it->second.version.expired()) {
    return -1;
  }
  return it->second.slot;
}

void ParameterVersions::addLocked(int64_t slot, const at::Tensor& version) {
  const c10::TensorImpl* key = version.unsafeGetTensorImpl();
  versions_.erase(key);
  versions_.emplace(key, Entry{WeakImpl(version.getIntrusivePtr()), slot});
  if (versions_.size() >= pruneAt_) {
    pruneLocked();
  }
}

void ParameterVersions::pruneLocked() {
  for (auto it = versions_.begin(); it != versions_.end();) {
    it = it->second.version.expired() ? versions_.erase(it) : std::next(it);
  }
  pruneAt_ = std::max<size_t>(64, 2 * versions_.size());
}

} // namespace autograd
} // namespace torchrpc
