#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/custom_class.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "torchrpc/autograd/context_container.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rref/rref.h"

namespace torchrpc {
namespace nn {

// What a RemoteModule refers to: one module living on its owner, held there
// through an RRef (a torch custom class, so that it never leaves its owner;
// a RemoteModule's moduleRRef() is an RRef<c10::intrusive_ptr<
// ModuleInstance>>). Programs use RemoteModule; this class is what the
// owner-side functions of nn/module_registry.h work on.
//
// Its parameters are owner RRefs (remoteParameters()), published by version
// as Note [Parameters updated while backward passes are pending] says: an
// optimizer step gives a parameter RRef a new value, and the next forward
// builds a new replica of the module around the new values (the registered
// factory, then a copy), so forwards already running keep the module they
// started with. Buffers (running statistics) carry over to the new replica;
// what a forward still running on an old replica writes to its buffers
// after that is not carried.
class ModuleInstance : public torch::CustomClassHolder {
 public:
  using Factory = std::function<std::shared_ptr<torch::nn::Module>()>;

  // Builds the module with `factory` on `device`. Runs on the owner.
  ModuleInstance(
      rpc::Runtime& runtime,
      std::string typeName,
      Factory factory,
      c10::Device device);

  const std::string& typeName() const {
    return typeName_;
  }
  c10::Device device() const {
    return device_;
  }

  // The module forwards run on: the current replica, rebuilt first if a
  // parameter got a new version since it was built.
  std::shared_ptr<torch::nn::Module> forwardReplica();

  // Owner RRefs of the parameters, in named_parameters() order.
  const std::vector<rref::RRef<at::Tensor>>& parameters() const {
    return parameters_;
  }
  std::vector<std::string> parameterNames() const {
    return names_;
  }

  // train(false) is eval(); applies to every later replica too.
  void train(bool on);
  bool training() const;

  // The module's parameters and buffers, in libtorch's serialize format
  // (torch::nn::Module::save), and their inverse, which publishes the
  // loaded values as new versions.
  void save(const std::string& path);
  void load(const std::string& path);
  // A copy of every parameter and buffer, by name.
  c10::Dict<std::string, at::Tensor> stateDict();

 private:
  std::shared_ptr<torch::nn::Module> build() const;
  // Makes `replica` current: its parameters become the parameter RRefs'
  // values, as new versions. Needs mutex_ and the update lock.
  void publishLocked(std::shared_ptr<torch::nn::Module> replica);

  const std::string typeName_;
  const Factory factory_;
  const c10::Device device_;
  const std::weak_ptr<autograd::ContextContainer> container_;
  std::vector<std::string> names_;
  std::vector<rref::RRef<at::Tensor>> parameters_;
  std::vector<int64_t> slots_;

  mutable std::mutex mutex_;
  std::shared_ptr<torch::nn::Module> replica_;
  // The parameter values replica_ was published with.
  std::vector<at::Tensor> published_;
  bool training_ = true;
};

} // namespace nn
} // namespace torchrpc
