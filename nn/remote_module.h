#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "torchrpc/nn/module_instance.h"
#include "torchrpc/nn/module_registry.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/future.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rref/rref.h"

namespace torchrpc {
namespace nn {

using ModuleRRef = rref::RRef<c10::intrusive_ptr<ModuleInstance>>;

namespace detail {

// "worker1/cpu" -> ("worker1", "cpu"); "worker1" -> ("worker1", "cpu").
std::pair<std::string, std::string> splitLocation(const std::string& on);

// Waits until the module exists; an unknown module type becomes an error
// that says so.
void awaitCreation(
    const ModuleRRef& module,
    const std::string& worker,
    const std::string& typeName);

} // namespace detail

template <typename M, typename Signature = typename detail::ForwardOf<M>::type>
class RemoteModule;

// A module M living on another worker (or this one), called like a local
// module: `forward(args...)` runs M's forward on the owner, typed, and takes
// part in distributed autograd. Its parameters are RRefs that a
// DistributedOptimizer steps where they live.
//
//   // on every worker that may own one, before start():
//   torchrpc::nn::registerModule<torch::nn::Linear, int64_t, int64_t>(rt);
//   // anywhere:
//   torchrpc::nn::RemoteModule<torch::nn::Linear> fc(rt, "worker1/cpu", 4, 3);
//   at::Tensor y = fc.forward(x);
//
// A cheap handle: copies refer to the same module, which lives until no
// handle (nor RRef to it) is left. A handle travels as a value: pass it to
// another worker inside a call and use it there. Beyond PyTorch's: train()
// and eval(), and save/load of the module's state on its owner.
//
// Errors are rpc::RpcError naming the owner: construction waits until the
// module exists (kUnknownFunction for a type not registered there,
// kBadArguments for wrong constructor arguments, kRemoteException if the
// constructor threw).
template <typename M, typename R, typename... Args>
class RemoteModule<M, R(Args...)> {
 public:
  // Creates the module on `on` ("worker1" or "worker1/cpu": worker and
  // device) as registered under moduleTypeName<M>().
  template <typename... CtorArgs>
  RemoteModule(rpc::Runtime& runtime, const std::string& on, CtorArgs&&... args)
      : RemoteModule(withTypeName(
            runtime,
            on,
            moduleTypeName<M>(),
            std::forward<CtorArgs>(args)...)) {}

  // Creates the module as registered under `typeName`
  // (registerModuleFactory).
  template <typename... CtorArgs>
  static RemoteModule withTypeName(
      rpc::Runtime& runtime,
      const std::string& on,
      const std::string& typeName,
      CtorArgs&&... args) {
    auto location = detail::splitLocation(on);
    auto module = rref::remote<c10::intrusive_ptr<ModuleInstance>>(
        runtime,
        location.first,
        detail::createFunction(typeName),
        location.second,
        std::forward<CtorArgs>(args)...);
    detail::awaitCreation(module, location.first, typeName);
    return RemoteModule(std::move(module), typeName);
  }

  // Wraps an existing module RRef (of a module of type `typeName`).
  explicit RemoteModule(
      ModuleRRef module,
      std::string typeName = moduleTypeName<M>())
      : module_(std::move(module)),
        typeName_(std::move(typeName)) {}

  R forward(Args... args) const {
    return forwardAsync(std::move(args)...).wait();
  }
  rpc::Future<R> forwardAsync(Args... args) const {
    return module_.template rpcAsync<R>(
        detail::forwardFunction(typeName_),
        std::move(args)...);
  }

  // The parameters, as RRefs owned by the module's owner, in
  // named_parameters() order: what a DistributedOptimizer takes.
  std::vector<rref::RRef<at::Tensor>> remoteParameters() const {
    return module_.template rpcSync<std::vector<rref::RRef<at::Tensor>>>(
        detail::kParameters);
  }

  void train(bool on = true) const {
    module_.template rpcSync<void>(detail::kTrain, on);
  }
  void eval() const {
    train(false);
  }

  // Saves the module's parameters and buffers on its owner, to `path` on
  // the owner's file system (libtorch's serialize format, as
  // torch::save(module)); load() reads them back there, into a new version
  // of every parameter.
  void save(const std::string& path) const {
    module_.template rpcSync<void>(detail::kSave, path);
  }
  void load(const std::string& path) const {
    module_.template rpcSync<void>(detail::kLoad, path);
  }
  // A copy of every parameter and buffer, by name.
  c10::Dict<std::string, at::Tensor> stateDict() const {
    return module_.template rpcSync<c10::Dict<std::string, at::Tensor>>(
        detail::kStateDict);
  }

  const ModuleRRef& moduleRRef() const {
    return module_;
  }
  const std::string& typeName() const {
    return typeName_;
  }
  const std::string& ownerName() const {
    return module_.ownerName();
  }

 private:
  ModuleRRef module_;
  std::string typeName_;
};

template <typename M>
class RemoteModule<M, void> {
  static_assert(
      sizeof(M) == 0,
      "cannot deduce the module's forward (overloaded, or a template as "
      "Sequential's): name it, RemoteModule<M, R(Args...)>");
};

} // namespace nn
} // namespace torchrpc

namespace torchrpc {
namespace rpc {
namespace detail {

// A RemoteModule travels as (module RRef, type name).
template <typename M, typename S>
struct ValueTraits<nn::RemoteModule<M, S>> {
  using RRefTraits = ValueTraits<nn::ModuleRRef>;
  static c10::TypePtr type() {
    return c10::TupleType::create({RRefTraits::type(), c10::StringType::get()});
  }
  static bool accepts(const c10::IValue& value) {
    if (!value.isTuple()) {
      return false;
    }
    const auto& elements = value.toTupleRef().elements();
    return elements.size() == 2 && RRefTraits::accepts(elements[0]) &&
        elements[1].isString();
  }
  static nn::RemoteModule<M, S> from(c10::IValue&& value) {
    const auto& elements = value.toTupleRef().elements();
    return nn::RemoteModule<M, S>(
        RRefTraits::from(c10::IValue(elements[0])),
        elements[1].toStringRef());
  }
  static c10::IValue toIValue(const nn::RemoteModule<M, S>& module) {
    return c10::ivalue::Tuple::create(
        module.moduleRRef().toIValue(),
        c10::IValue(module.typeName()));
  }
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
