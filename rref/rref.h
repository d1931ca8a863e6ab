#pragma once

#include <ATen/core/ivalue.h>

#include <chrono>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "torchrpc/rpc/future.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rpc/value_types.h"
#include "torchrpc/rref/rref_context.h"
#include "torchrpc/rref/rref_handle.h"

namespace torchrpc {
namespace rref {

template <typename T>
class RRef;

namespace detail {

template <typename... Args>
std::vector<c10::IValue> packArguments(Args&&... args) {
  std::vector<c10::IValue> values;
  values.reserve(sizeof...(Args));
  (values.push_back(rpc::detail::toIValue(std::forward<Args>(args))), ...);
  return values;
}

} // namespace detail

// A reference to a value of type T owned by one worker (see
// Note [RRef fork protocol] in rref/rref_context.h). A cheap handle: copies
// refer to the same reference, and the owner keeps the value until no
// reference is left anywhere. RRefs are values: pass them as arguments and
// results of any call, also inside lists, tuples and dicts; registered
// functions may take and return RRef<T>.
//
// Errors: methods returning a Future never throw; wait() rethrows an
// RpcError naming the owner and the operation. If creating the value failed
// (remote()'s function threw, its call failed or timed out), every use
// fails with that original error.
template <typename T>
class RRef {
 public:
  RRef() = default;
  explicit RRef(c10::intrusive_ptr<detail::RRefHandle> handle)
      : handle_(std::move(handle)) {}

  // An owner RRef of a value of this worker.
  static RRef<T> local(rpc::Runtime& runtime, T value) {
    return RRef<T>(RRefContext::of(runtime)->makeOwned(
        rpc::detail::toIValue(std::move(value)),
        rpc::detail::ValueTraits<T>::type()));
  }

  // The RRef inside `value`; throws c10::Error if it holds no torchrpc
  // RRef, or one whose type is not T.
  static RRef<T> fromIValue(const c10::IValue& value) {
    auto handle = detail::handleOf(value);
    TORCH_CHECK(
        handle,
        value.isRRef() ? "expected an RRef that torchrpc created, got "
                         "another library's (or an empty) "
                       : "expected an RRef, got a value of type ",
        rpc::detail::typeName(value));
    TORCH_CHECK(
        typeMatches(*handle),
        "expected an RRef[",
        rpc::detail::typeName<T>(),
        "], got an RRef[",
        handle->type()->annotation_str(),
        "]");
    return RRef<T>(std::move(handle));
  }

  c10::IValue toIValue() const {
    return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(handle_));
  }

  bool defined() const {
    return handle_.defined();
  }
  const RRefId& id() const {
    return handle().id();
  }
  const rpc::WorkerInfo& owner() const {
    return handle().ownerInfo();
  }
  const std::string& ownerName() const {
    return handle().ownerInfo().name;
  }
  bool isOwner() const {
    return handle().isOwner();
  }
  // True on the owner, and on a user once the owner has registered its
  // reference.
  bool confirmedByOwner() const {
    return handle().confirmedByOwner();
  }

  // Completes once confirmedByOwner() holds; on the creator that is once
  // the value exists, and it fails with the creation error if that failed.
  rpc::Future<void> confirmedAsync() const {
    auto context = detail::contextOf(handle());
    if (!context) {
      return typed<void>(detail::runtimeGoneFuture(handle(), "RRef.confirm"));
    }
    return typed<void>(context->confirmation(handle()), "RRef.confirm");
  }

  // A copy of the value, on any worker (on the owner too). A zero timeout
  // means the runtime's default.
  rpc::Future<T> toHereAsync(
      std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) const {
    auto context = detail::contextOf(handle());
    if (!context) {
      return typed<T>(detail::runtimeGoneFuture(handle(), "RRef.toHere"));
    }
    return typed<T>(
        context->toHere(handle(), orDefault(*context, timeout)),
        "RRef.toHere");
  }
  T toHere(
      std::chrono::milliseconds timeout = std::chrono::milliseconds(0)) const {
    return toHereAsync(timeout).wait();
  }

  // The value itself; only on the owner (throws c10::Error elsewhere).
  // Waits for the value to be created.
  T localValue() const {
    auto context = detail::contextOf(handle());
    TORCH_CHECK(context, "the runtime of this RRef is gone");
    return rpc::detail::convertResult<T>(
        context->localValue(handle()),
        ownerName(),
        "RRef.localValue");
  }

  // Replaces the value; only on the owner, once the value exists (throws
  // c10::Error elsewhere). Later uses (localValue, toHere, calls on the
  // owner) see `value`; uses already running keep the value they read. The
  // DistributedOptimizer publishes each new version of a parameter this way
  // (see Note [Parameters updated while backward passes are pending] in
  // autograd/parameter_versions.h).
  void setLocalValue(T value) const {
    auto context = detail::contextOf(handle());
    TORCH_CHECK(context, "the runtime of this RRef is gone");
    context->setLocalValue(handle(), rpc::detail::toIValue(std::move(value)));
  }

  // Runs the registered function `function` on the owner with the value
  // itself (not a copy) as its first argument: function(value, args...).
  template <typename R, typename... Args>
  rpc::Future<R> rpcAsync(const std::string& function, Args&&... args) const {
    auto context = detail::contextOf(handle());
    if (!context) {
      return typed<R>(detail::runtimeGoneFuture(handle(), function), function);
    }
    return typed<R>(
        context->callOn(
            handle(),
            function,
            detail::packArguments(std::forward<Args>(args)...),
            context->defaultTimeout()),
        function);
  }
  template <typename R, typename... Args>
  R rpcSync(const std::string& function, Args&&... args) const {
    return rpcAsync<R>(function, std::forward<Args>(args)...).wait();
  }

  // A new RRef, owned by the same owner, of function(value, args...).
  template <typename R, typename... Args>
  RRef<R> remote(const std::string& function, Args&&... args) const {
    auto context = detail::contextOf(handle());
    TORCH_CHECK(context, "the runtime of this RRef is gone");
    return RRef<R>(context->remote(
        rpc::WorkerRef(owner()),
        function,
        detail::packArguments(std::forward<Args>(args)...),
        rpc::detail::ValueTraits<R>::type(),
        context->defaultTimeout(),
        &handle()));
  }

  const detail::RRefHandle& handle() const {
    TORCH_CHECK(handle_.defined(), "the RRef is empty");
    return *handle_;
  }

  static bool typeMatches(const detail::RRefHandle& handle) {
    const auto& type = handle.type();
    return type->kind() == c10::TypeKind::AnyType ||
        type->isSubtypeOf(*rpc::detail::ValueTraits<T>::type());
  }

 private:
  template <typename U>
  rpc::Future<U> typed(
      c10::intrusive_ptr<c10::ivalue::Future> future,
      const std::string& what = "") const {
    return rpc::Future<U>(std::move(future), ownerName(), what);
  }

  static std::chrono::milliseconds orDefault(
      const RRefContext& context,
      std::chrono::milliseconds timeout) {
    return timeout.count() > 0 ? timeout : context.defaultTimeout();
  }

  c10::intrusive_ptr<detail::RRefHandle> handle_;
};

template <typename T, typename... Args>
RRef<T> remoteWithTimeout(
    rpc::Runtime& runtime,
    std::chrono::milliseconds timeout,
    const rpc::WorkerRef& to,
    const std::string& function,
    Args&&... args);

// remote(): runs `function` (a registered function or a builtin operator) on
// `to`, which owns the result; returns at once. Never throws for a failed
// call: the RRef's uses fail with the error (see RRef).
template <typename T, typename... Args>
RRef<T> remote(
    rpc::Runtime& runtime,
    const rpc::WorkerRef& to,
    const std::string& function,
    Args&&... args) {
  return remoteWithTimeout<T>(
      runtime,
      std::chrono::milliseconds(0),
      to,
      function,
      std::forward<Args>(args)...);
}

// remote() whose creation must finish within `timeout` (zero: the runtime's
// default), or the RRef fails with kTimeout.
template <typename T, typename... Args>
RRef<T> remoteWithTimeout(
    rpc::Runtime& runtime,
    std::chrono::milliseconds timeout,
    const rpc::WorkerRef& to,
    const std::string& function,
    Args&&... args) {
  auto context = RRefContext::of(runtime);
  return RRef<T>(context->remote(
      to,
      function,
      detail::packArguments(std::forward<Args>(args)...),
      rpc::detail::ValueTraits<T>::type(),
      timeout.count() > 0 ? timeout : context->defaultTimeout()));
}

} // namespace rref
} // namespace torchrpc

namespace torchrpc {
namespace rpc {
namespace detail {

// RRef<T> as an argument or result of registered functions and calls, also
// inside std::vector, c10::optional, std::tuple and std::unordered_map (see
// Note [Values in containers] in rpc/value_types.h). Its values are checked
// one by one: an IValue of type RRef[T] may hold an RRef that torchrpc did
// not create (PyTorch's own) or none at all.
template <typename T>
struct ValueTraits<rref::RRef<T>> {
  static c10::TypePtr type() {
    static const c10::TypePtr type =
        c10::RRefType::create(ValueTraits<T>::type());
    return type;
  }
  static bool accepts(const c10::IValue& value) {
    auto handle = rref::detail::handleOf(value);
    return handle && rref::RRef<T>::typeMatches(*handle);
  }
  static std::string explain(const c10::IValue& value) {
    // Otherwise the type name says it: "int", "RRef[int]", "RRef (empty)".
    if (!value.isRRef() || !value.toRRef() || rref::detail::handleOf(value)) {
      return "";
    }
    return "an RRef that torchrpc did not create";
  }
  // Throws c10::Error for a value accepts() refuses.
  static rref::RRef<T> from(c10::IValue&& value) {
    auto handle = rref::detail::handleOf(value);
    TORCH_CHECK(
        handle,
        "expected an ",
        type()->annotation_str(),
        " created by torchrpc, got a value of type ",
        describeValue<rref::RRef<T>>(value));
    TORCH_CHECK(
        rref::RRef<T>::typeMatches(*handle),
        "expected an ",
        type()->annotation_str(),
        ", got an RRef[",
        handle->type()->annotation_str(),
        "]");
    return rref::RRef<T>(std::move(handle));
  }
  // An empty RRef travels as None: a c10::optional<RRef<T>> receives
  // nullopt, an RRef<T> refuses it with kBadArguments.
  static c10::IValue toIValue(const rref::RRef<T>& value) {
    return value.defined() ? value.toIValue() : c10::IValue();
  }
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
