#include "torchrpc/nn/module_instance.h"

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <utility>

namespace torchrpc {
namespace nn {

namespace {

// Makes c10::intrusive_ptr<ModuleInstance> a value type an RRef can hold.
const auto kRegistration =
    torch::class_<ModuleInstance>("torchrpc", "ModuleInstance");

} // namespace

ModuleInstance::ModuleInstance(
    rpc::Runtime& runtime,
    std::string typeName,
    Factory factory,
    c10::Device device)
    : typeName_(std::move(typeName)),
      factory_(std::move(factory)),
      device_(device),
      container_(autograd::ContextContainer::of(runtime)) {
  auto replica = build();
  auto& versions = autograd::ContextContainer::of(runtime)->parameterVersions();
  for (const auto& item : replica->named_parameters()) {
    names_.push_back(item.key());
    parameters_.push_back(rref::RRef<at::Tensor>::local(runtime, item.value()));
    slots_.push_back(versions.slotOf(item.value()));
    published_.push_back(item.value());
  }
  replica_ = std::move(replica);
}

std::shared_ptr<torch::nn::Module> ModuleInstance::build() const {
  auto module = factory_();
  TORCH_CHECK(module, "the factory of module type '", typeName_, "' gave none");
  module->to(device_);
  return module;
}

std::shared_ptr<torch::nn::Module> ModuleInstance::forwardReplica() {
  std::lock_guard<std::mutex> guard(mutex_);
  bool current = true;
  for (size_t i = 0; i < parameters_.size() && current; ++i) {
    current = parameters_[i].localValue().is_same(published_[i]);
  }
  if (current) {
    return replica_;
  }
  auto container = container_.lock();
  TORCH_CHECK(container, "the runtime is gone");
  // Under the update lock, so that the replica never mixes parameters of
  // one step with those of the step before.
  auto updates = container->parameterVersions().lockUpdates();
  auto replica = build();
  {
    at::NoGradGuard noGrad;
    auto targets = replica->parameters();
    for (size_t i = 0; i < parameters_.size(); ++i) {
      targets[i].copy_(parameters_[i].localValue());
    }
    auto from = replica_->buffers();
    auto to = replica->buffers();
    for (size_t i = 0; i < to.size() && i < from.size(); ++i) {
      to[i].copy_(from[i]);
    }
  }
  publishLocked(replica);
  return replica_;
}

void ModuleInstance::publishLocked(std::shared_ptr<torch::nn::Module> replica) {
  auto container = container_.lock();
  TORCH_CHECK(container, "the runtime is gone");
  auto& versions = container->parameterVersions();
  replica->train(training_);
  auto values = replica->parameters();
  TORCH_CHECK(
      values.size() == parameters_.size(),
      "a new replica of module type '",
      typeName_,
      "' has ",
      values.size(),
      " parameters, the first had ",
      parameters_.size());
  for (size_t i = 0; i < values.size(); ++i) {
    versions.add(slots_[i], values[i]);
    parameters_[i].setLocalValue(values[i]);
    published_[i] = values[i];
  }
  replica_ = std::move(replica);
}

void ModuleInstance::train(bool on) {
  std::lock_guard<std::mutex> guard(mutex_);
  training_ = on;
  replica_->train(on);
}

bool ModuleInstance::training() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return training_;
}

void ModuleInstance::save(const std::string& path) {
  auto module = forwardReplica();
  torch::serialize::OutputArchive archive;
  module->save(archive);
  archive.save_to(path);
}

void ModuleInstance::load(const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path, device_);
  auto replica = build();
  replica->load(archive);
  auto container = container_.lock();
  TORCH_CHECK(container, "the runtime is gone");
  std::lock_guard<std::mutex> guard(mutex_);
  auto updates = container->parameterVersions().lockUpdates();
  publishLocked(std::move(replica));
}

c10::Dict<std::string, at::Tensor> ModuleInstance::stateDict() {
  auto module = forwardReplica();
  c10::Dict<std::string, at::Tensor> out;
  for (const auto& item : module->named_parameters()) {
    out.insert(item.key(), item.value().detach().clone());
  }
  for (const auto& item : module->named_buffers()) {
    out.insert(item.key(), item.value().detach().clone());
  }
  return out;
}

} // namespace nn
} // namespace torchrpc
