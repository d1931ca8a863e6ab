#pragma once

// Making module types available on a worker, so that RemoteModules can be
// created there.

#include <c10/util/Type.h>
#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "torchrpc/nn/module_instance.h"
#include "torchrpc/rpc/function_registry.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace nn {
namespace detail {

// Owner-side functions every module type shares.
constexpr const char* kParameters = "torchrpc.nn.parameters";
constexpr const char* kTrain = "torchrpc.nn.train";
constexpr const char* kSave = "torchrpc.nn.save";
constexpr const char* kLoad = "torchrpc.nn.load";
constexpr const char* kStateDict = "torchrpc.nn.state_dict";

inline std::string createFunction(const std::string& typeName) {
  return "torchrpc.nn.create:" + typeName;
}
inline std::string forwardFunction(const std::string& typeName) {
  return "torchrpc.nn.forward:" + typeName;
}

// Registers the shared functions once per runtime.
void registerSharedFunctions(rpc::Runtime& runtime);

// The module class itself: M for a torch::nn::Module subclass, M's Impl for
// one of libtorch's holders (torch::nn::Linear -> LinearImpl).
template <typename M, typename = void>
struct ImplOfT {
  using type = typename M::ContainedType;
};
template <typename M>
struct ImplOfT<
    M,
    std::enable_if_t<std::is_base_of<torch::nn::Module, M>::value>> {
  using type = M;
};
template <typename M>
using ImplOf = typename ImplOfT<M>::type;

// M's forward as a signature R(Args...), or void when it cannot be deduced
// (overloaded, or a template as Sequential's).
template <typename F>
struct MemberSignature {
  using type = void;
};
template <typename C, typename R, typename... A>
struct MemberSignature<R (C::*)(A...)> {
  using type = R(std::decay_t<A>...);
};
template <typename C, typename R, typename... A>
struct MemberSignature<R (C::*)(A...) const> {
  using type = R(std::decay_t<A>...);
};
template <typename M, typename = void>
struct ForwardOf {
  using type = void;
};
template <typename M>
struct ForwardOf<M, std::void_t<decltype(&ImplOf<M>::forward)>> {
  using type = typename MemberSignature<decltype(&ImplOf<M>::forward)>::type;
};

template <typename T>
struct IsSharedPtr : std::false_type {};
template <typename T>
struct IsSharedPtr<std::shared_ptr<T>> : std::true_type {};

// What a factory returned, as the module itself.
template <typename M, typename Made>
std::shared_ptr<torch::nn::Module> asModule(Made&& made) {
  if constexpr (IsSharedPtr<std::decay_t<Made>>::value) {
    return std::forward<Made>(made); // a std::shared_ptr to the module
  } else {
    return made.ptr(); // one of libtorch's holders
  }
}

template <typename M, typename Factory, typename... A>
void addCreate(
    rpc::Runtime& runtime,
    const std::string& typeName,
    Factory factory,
    std::tuple<A...>*) {
  rpc::Runtime* owner = &runtime;
  runtime.functions().add(
      createFunction(typeName),
      [owner, typeName, factory](std::string device, A... args) {
        ModuleInstance::Factory make = [factory, args...]() {
          return asModule<M>(factory(args...));
        };
        return c10::make_intrusive<ModuleInstance>(
            *owner,
            typeName,
            std::move(make),
            c10::Device(device));
      });
}

template <typename M, typename R, typename... A>
void addForward(
    rpc::Runtime& runtime,
    const std::string& typeName,
    R (*)(A...)) {
  runtime.functions().add(
      forwardFunction(typeName),
      [typeName](c10::intrusive_ptr<ModuleInstance> instance, A... args) -> R {
        TORCH_CHECK(
            instance->typeName() == typeName,
            "the module is a '",
            instance->typeName(),
            "', not a '",
            typeName,
            "'");
        // Module is a virtual base of libtorch's modules: no static_cast.
        auto module =
            std::dynamic_pointer_cast<ImplOf<M>>(instance->forwardReplica());
        TORCH_CHECK(module, "the module is no '", typeName, "'");
        return module->forward(std::move(args)...);
      });
}

} // namespace detail

// The name a module type is registered under by default: its C++ name
// ("torch::nn::Linear"), the same in every process built from the same
// sources.
template <typename M>
std::string moduleTypeName() {
  return c10::demangle_type<M>();
}

// Makes module type M creatable on this worker under `typeName`, built by
// `factory(args...)` (which returns an M, one of libtorch's holders such as
// torch::nn::Linear, or a std::shared_ptr to a torch::nn::Module subclass).
// The constructor arguments are the factory's parameters and travel as
// values (types checked on every creation). `Signature` is M's forward,
// R(Args...); it is deduced when M has one non-template forward and must be
// given otherwise (torch::nn::Sequential: at::Tensor(at::Tensor)).
// Register before start() on every worker that may own such modules.
template <
    typename M,
    typename Signature = typename detail::ForwardOf<M>::type,
    typename Factory>
void registerModuleFactory(
    rpc::Runtime& runtime,
    const std::string& typeName,
    Factory factory) {
  static_assert(
      !std::is_void<Signature>::value,
      "cannot deduce the module's forward (overloaded, or a template as "
      "Sequential's): name it, registerModuleFactory<M, R(Args...)>");
  using Args =
      typename rpc::detail::CallableTraits<std::decay_t<Factory>>::Args;
  detail::registerSharedFunctions(runtime);
  detail::addCreate<M>(
      runtime,
      typeName,
      std::move(factory),
      static_cast<Args*>(nullptr));
  detail::addForward<M>(
      runtime,
      typeName,
      static_cast<std::add_pointer_t<Signature>>(nullptr));
}

// Makes module type M, built as M(CtorArgs...), creatable on this worker
// under moduleTypeName<M>():
//
//   torchrpc::nn::registerModule<torch::nn::Linear, int64_t, int64_t>(rt);
template <typename M, typename... CtorArgs>
void registerModule(rpc::Runtime& runtime) {
  registerModuleFactory<M>(runtime, moduleTypeName<M>(), [](CtorArgs... args) {
    if constexpr (std::is_base_of<torch::nn::Module, M>::value) {
      return std::make_shared<M>(std::move(args)...);
    } else {
      return M(std::move(args)...);
    }
  });
}

} // namespace nn
} // namespace torchrpc
