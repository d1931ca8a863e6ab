#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/future.h"
#include "torchrpc/rpc/value_types.h"

namespace torchrpc {
namespace rpc {

// How a registered function is served.
struct FunctionOptions {
  // Runs where the call arrives, on the transport's thread, instead of being
  // queued to the runtime's thread pool: one hand-off less per call (see
  // Note [Where messages are handled] in rpc/agent.cpp). Only for functions
  // that never block (no waiting on other calls, on locks held for long, on
  // I/O) and finish in microseconds: the connection's other messages wait
  // meanwhile. A cheap function may still return a Future and complete it
  // later.
  bool cheap = false;
};

// A function as the runtime stores it: its name, a signature for messages,
// and a boxed entry point.
struct RegisteredFunction {
  std::string name;
  FunctionOptions options;
  // e.g. "scale(Tensor, float) -> Tensor"
  std::string signature;
  // Checks the arguments against the signature and runs the function.
  // Throws RpcError(kBadArguments) before running anything if the arguments
  // do not fit. Whatever the function itself throws, or the error of the
  // future it returns, comes back as the error of the returned future.
  std::function<c10::intrusive_ptr<c10::ivalue::Future>(
      std::vector<c10::IValue>&&)>
      invoke;
};

namespace detail {

template <typename F>
struct CallableTraits : CallableTraits<decltype(&F::operator())> {};
template <typename R, typename... A>
struct CallableTraits<R (*)(A...)> {
  using Result = R;
  using Args = std::tuple<std::decay_t<A>...>;
};
template <typename R, typename... A>
struct CallableTraits<R(A...)> : CallableTraits<R (*)(A...)> {};
template <typename C, typename R, typename... A>
struct CallableTraits<R (C::*)(A...) const> : CallableTraits<R (*)(A...)> {};
template <typename C, typename R, typename... A>
struct CallableTraits<R (C::*)(A...)> : CallableTraits<R (*)(A...)> {};

template <typename T>
struct IsTypedFuture : std::false_type {};
template <typename T>
struct IsTypedFuture<Future<T>> : std::true_type {};

template <typename R>
constexpr bool kIsAsyncResult = IsTypedFuture<R>::value ||
    std::is_same<R, c10::intrusive_ptr<c10::ivalue::Future>>::value;

template <typename R>
std::string resultTypeName() {
  if constexpr (std::is_void<R>::value) {
    return "None";
  } else if constexpr (IsTypedFuture<R>::value) {
    return "Future[" + resultTypeName<typename R::ValueType>() + "]";
  } else if constexpr (kIsAsyncResult<R>) {
    return "Future[Any]";
  } else {
    return typeName<R>();
  }
}

template <typename Args, size_t... I>
std::string argumentTypeNames(std::index_sequence<I...>) {
  std::string out;
  ((out += (I == 0 ? "" : ", ") + typeName<std::tuple_element_t<I, Args>>()),
   ...);
  return out;
}

// Throws RpcError(kBadArguments) if args[index] does not fit T.
template <typename T>
void checkArgument(
    const std::string& name,
    const std::string& signature,
    const std::vector<c10::IValue>& args,
    size_t index) {
  if (!ValueTraits<T>::accepts(args[index])) {
    throw RpcError(
        ErrorCode::kBadArguments,
        "",
        name,
        0,
        "argument " + std::to_string(index + 1) + " has type " +
            describeValue<T>(args[index]) + ", expected " + typeName<T>() +
            " (" + signature + ")");
  }
}

template <typename Args, size_t... I>
void checkArguments(
    const std::string& name,
    const std::string& signature,
    const std::vector<c10::IValue>& args,
    std::index_sequence<I...>) {
  if (args.size() != sizeof...(I)) {
    throw RpcError(
        ErrorCode::kBadArguments,
        "",
        name,
        0,
        "expects " + std::to_string(sizeof...(I)) + " argument(s) (" +
            signature + "), got " + std::to_string(args.size()));
  }
  (checkArgument<std::tuple_element_t<I, Args>>(name, signature, args, I), ...);
}

// Runs fn on converted arguments and turns its outcome into a future.
template <typename R, typename Args, typename F, size_t... I>
c10::intrusive_ptr<c10::ivalue::Future> invokeChecked(
    F& fn,
    std::vector<c10::IValue>&& args,
    std::index_sequence<I...>) {
  auto call = [&]() -> decltype(auto) {
    return fn(ValueTraits<std::tuple_element_t<I, Args>>::from(
        std::move(args[I]))...);
  };
  auto ready = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  try {
    if constexpr (std::is_void<R>::value) {
      call();
      ready->markCompleted(c10::IValue());
    } else if constexpr (IsTypedFuture<R>::value) {
      return call().ivalue();
    } else if constexpr (kIsAsyncResult<R>) {
      return call();
    } else {
      ready->markCompleted(toIValue(call()));
    }
  } catch (...) {
    ready->setError(std::current_exception());
  }
  return ready;
}

template <typename F>
RegisteredFunction makeRegisteredFunction(std::string name, F&& fn) {
  using Traits = CallableTraits<std::decay_t<F>>;
  using R = typename Traits::Result;
  using Args = typename Traits::Args;
  using Indices = std::make_index_sequence<std::tuple_size<Args>::value>;
  RegisteredFunction entry;
  entry.name = name;
  entry.signature = name + "(" + argumentTypeNames<Args>(Indices{}) + ") -> " +
      resultTypeName<R>();
  entry.invoke =
      [fn = std::forward<F>(fn),
       name = std::move(name),
       signature = entry.signature](std::vector<c10::IValue>&& args) mutable {
        checkArguments<Args>(name, signature, args, Indices{});
        return invokeChecked<R, Args>(fn, std::move(args), Indices{});
      };
  return entry;
}

} // namespace detail

// Functions callable by name from other workers. Owned by one Runtime.
// Thread-safe: functions may be added while calls are served.
class FunctionRegistry {
 public:
  // Registers an ordinary C++ callable (function pointer, lambda, functor
  // with one operator()). Argument and return types are deduced from its
  // signature and checked on every call. Supported types: at::Tensor, bool,
  // integers, floating types, std::string, c10::Device, std::vector<T>,
  // c10::optional<T>, std::tuple<...>, c10::List<T>, c10::Dict<K, V>,
  // std::unordered_map<K, V>, c10::IValue (anything), and an upper layer's
  // types with their own ValueTraits (RRef<T>), also inside the std::
  // containers and c10::optional (see Note [Values in containers] in
  // rpc/value_types.h). A callable may return Future<T> (or a
  // c10::ivalue::Future) to run asynchronously: the server thread is
  // released at once and the reply goes out when it completes.
  // Throws c10::Error if the name is empty or already registered.
  template <typename F>
  void add(const std::string& name, F&& fn, FunctionOptions options = {}) {
    RegisteredFunction function =
        detail::makeRegisteredFunction(name, std::forward<F>(fn));
    function.options = options;
    addBoxed(std::move(function));
  }

  void addBoxed(RegisteredFunction function);

  // nullptr if no function has that name.
  std::shared_ptr<const RegisteredFunction> find(const std::string& name) const;

  std::vector<std::string> names() const;

 private:
  mutable std::mutex mutex_;
  std::unordered_map<std::string, std::shared_ptr<const RegisteredFunction>>
      functions_;
};

} // namespace rpc
} // namespace torchrpc
