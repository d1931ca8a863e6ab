#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/request_scope.h"
#include "torchrpc/rpc/value_types.h"

namespace torchrpc {
namespace rpc {

namespace detail {
// Converts a call's result to T, or throws RpcError(kBadArguments) naming
// what was expected and what arrived, and the call's worker and function.
template <typename T>
T convertResult(
    c10::IValue&& value,
    const std::string& worker,
    const std::string& function) {
  if constexpr (std::is_void<T>::value) {
    return;
  } else {
    if (!ValueTraits<T>::accepts(value)) {
      throw RpcError(
          ErrorCode::kBadArguments,
          worker,
          function,
          0,
          "result has type " + describeValue<T>(value) +
              ", the caller expects " + typeName<T>());
    }
    return ValueTraits<T>::from(std::move(value));
  }
}

// Polls `future` between yields for at most `limit`, and stops early when
// the CPU is wanted by others: see Note [Spinning on a busy machine] in
// rpc/detail/busy_wait.h.
void spinUntilCompleted(
    const c10::ivalue::Future& future,
    std::chrono::microseconds limit);

// Note [Replies completed where they are read]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Completing a future runs its callbacks on the completing thread, so the
// agent hands a response to its pool unless it knows the future has none
// (Note [Where messages are handled] in rpc/agent.cpp). A future that
// rpcAsync returns is reachable only through its Future<T> until then() or
// ivalue() hands it on, and both tell this object first. So the thread that
// reads the response (the transport's, or a caller's waiting for any reply,
// Note [Waiting callers drive the transport]) completes it at once when no
// callback was attached, and the caller's wait() finds it done: no pool
// thread per reply, which with many calls outstanding on a 2-CPU machine
// was a third busy thread beside the caller and its peer. The race between
// a reader completing and a callback being attached is settled here: the
// reader claims the completion, or the callback side forbids it. The agent
// claims and takes the call out of its table under one lock, so nothing
// else completes a claimed future, and only decoding the reply (message
// hooks, value extensions, which must not block) comes between the claim
// and the completion. A callback side that finds it claimed waits for the
// completion, then attaches, so its callback runs on its own thread.
// Internal callbacks that only wake a waiter (busy_wait.cpp) may run on any
// thread and need not forbid.
class InlineCompletion {
 public:
  // The reading thread: true if it may complete the future itself; it then
  // must, having taken the call out of the table under the same lock.
  bool claim() noexcept {
    int open = kOpen;
    return state_.compare_exchange_strong(open, kClaimed);
  }

  // Before anything may attach a callback to `future`: from now on no
  // reader claims it, and one that already has has completed it when this
  // returns.
  void forbid(c10::ivalue::Future& future) {
    int open = kOpen;
    if (state_.compare_exchange_strong(open, kForbidden) ||
        open == kForbidden) {
      return;
    }
    // Claimed: the claimer is decoding the reply, usually for a few
    // microseconds; past a short spin, sleep until it is done.
    for (int spins = 0; spins < kClaimedSpins && !future.completed(); ++spins) {
      std::this_thread::yield();
    }
    future.wait();
  }

 private:
  static constexpr int kOpen = 0;
  static constexpr int kClaimed = 1;
  static constexpr int kForbidden = 2;
  static constexpr int kClaimedSpins = 100;
  std::atomic<int> state_{kOpen};
};
} // namespace detail

// A typed handle on a c10::ivalue::Future, the one future type torchrpc and
// libtorch's autograd speak. Completes with a value of type T or with an
// RpcError; wait() rethrows the error. Callbacks passed to then() run on the
// thread that completes the future (an agent thread): keep them short, or
// return a Future from a handler instead of waiting inside it.
namespace detail {
template <typename T, typename F>
struct ThenResult {
  using type = std::decay_t<std::invoke_result_t<F, T>>;
};
template <typename F>
struct ThenResult<void, F> {
  using type = std::decay_t<std::invoke_result_t<F>>;
};
} // namespace detail

template <typename T>
class Future {
 public:
  using ValueType = T;

  Future() = default;
  // worker and function name the call in errors about the result's type.
  explicit Future(
      c10::intrusive_ptr<c10::ivalue::Future> impl,
      std::string worker = "",
      std::string function = "")
      : impl_(std::move(impl)),
        worker_(std::move(worker)),
        function_(std::move(function)) {}
  // A future whose completer may complete it where the reply is read while
  // no callback is attached (Note [Replies completed where they are read]).
  Future(
      c10::intrusive_ptr<c10::ivalue::Future> impl,
      std::string worker,
      std::string function,
      std::shared_ptr<detail::InlineCompletion> inlineCompletion)
      : impl_(std::move(impl)),
        worker_(std::move(worker)),
        function_(std::move(function)),
        inlineCompletion_(std::move(inlineCompletion)) {}

  // Blocks until completion; returns the value or throws the error (an
  // RpcError for everything torchrpc raises). Polls briefly before it
  // sleeps: a reply that comes within kWaitSpin then needs no wake-up
  // (see Note [Adaptive spin] in rpc/detail/spinning_thread_pool.h), unless
  // the CPU is contended (Note [Spinning on a busy machine]).
  T wait() const {
    detail::spinUntilCompleted(*impl_, kWaitSpin);
    impl_->waitAndThrow();
    return detail::convertResult<T>(impl_->value(), worker_, function_);
  }

  bool completed() const {
    return impl_->completed();
  }
  bool hasError() const {
    return impl_->hasError();
  }
  std::exception_ptr error() const {
    return impl_->exception_ptr();
  }

  // Chains fn(T) -> U (U may be void). An error of this future, or one that
  // fn throws, becomes the error of the returned future. fn runs in the
  // RequestScope that was current when then() was called.
  template <typename F>
  auto then(F&& fn) const {
    using U = typename detail::ThenResult<T, F>::type;
    forbidInlineCompletion();
    auto child = impl_->then(
        [fn = std::forward<F>(fn),
         worker = worker_,
         function = function_,
         scope = currentRequestScope()](
            c10::ivalue::Future& parent) mutable -> c10::IValue {
          // Continuations of a handler belong to its request.
          RequestScopeGuard inScope(scope);
          if constexpr (std::is_void<T>::value) {
            parent.value(); // rethrows the parent's error
            return invokeToIValue<U>(fn);
          } else {
            return invokeToIValue<U>(
                fn,
                detail::convertResult<T>(parent.value(), worker, function));
          }
        },
        c10::AnyType::get());
    return Future<U>(std::move(child), worker_, function_);
  }

  // The underlying libtorch future. Its callbacks run on the thread that
  // completes it, an agent thread.
  const c10::intrusive_ptr<c10::ivalue::Future>& ivalue() const {
    // Whoever gets it may attach callbacks.
    forbidInlineCompletion();
    return impl_;
  }

 private:
  void forbidInlineCompletion() const {
    if (inlineCompletion_) {
      inlineCompletion_->forbid(*impl_);
    }
  }

  static constexpr std::chrono::microseconds kWaitSpin{1000};

  template <typename U, typename F, typename... Args>
  static c10::IValue invokeToIValue(F& fn, Args&&... args) {
    if constexpr (std::is_void<U>::value) {
      fn(std::forward<Args>(args)...);
      return c10::IValue();
    } else {
      return detail::toIValue(fn(std::forward<Args>(args)...));
    }
  }

  c10::intrusive_ptr<c10::ivalue::Future> impl_;
  std::string worker_;
  std::string function_;
  // Shared with the agent's pending call; null when the agent never
  // completes this future where the reply is read.
  std::shared_ptr<detail::InlineCompletion> inlineCompletion_;
};

template <>
inline void Future<void>::wait() const {
  detail::spinUntilCompleted(*impl_, kWaitSpin);
  impl_->waitAndThrow();
}

// ---- Helpers on the untyped future ------------------------------------------
// For handlers (see rpc/request.h) and the layers above, which speak
// c10::ivalue::Future directly. libtorch has c10::collectAll (completes with
// the first error as soon as it comes, else once all succeeded) and
// c10::collectAny; what it lacks is here.

// A future that has already completed with `value` (None by default).
inline c10::intrusive_ptr<c10::ivalue::Future> readyFuture(
    c10::IValue value = c10::IValue()) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  future->markCompleted(std::move(value));
  return future;
}

// A future that has already failed with `error`.
inline c10::intrusive_ptr<c10::ivalue::Future> failedFuture(
    std::exception_ptr error) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  future->setError(std::move(error));
  return future;
}

// Completes `to` as `from` (completed) did: with its value or its error.
inline void completeFrom(c10::ivalue::Future& from, c10::ivalue::Future& to) {
  if (from.hasError()) {
    to.setError(from.exception_ptr());
  } else {
    to.markCompleted(from.value());
  }
}

// Completes (with None) once every one of `futures` has, successful or not;
// with the first error among them, if any. Unlike c10::collectAll it never
// completes early, so what it follows has all settled when it does.
inline c10::intrusive_ptr<c10::ivalue::Future> allSettled(
    const std::vector<c10::intrusive_ptr<c10::ivalue::Future>>& futures) {
  if (futures.empty()) {
    return readyFuture();
  }
  struct State {
    explicit State(size_t count) : remaining(count) {}
    std::atomic<size_t> remaining;
    std::mutex errorMutex; // only taken for a failed future
    std::exception_ptr firstError;
    c10::intrusive_ptr<c10::ivalue::Future> all =
        c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  };
  auto state = std::make_shared<State>(futures.size());
  for (const auto& future : futures) {
    future->addCallback([state](c10::ivalue::Future& done) {
      if (done.hasError()) {
        std::lock_guard<std::mutex> guard(state->errorMutex);
        if (!state->firstError) {
          state->firstError = done.exception_ptr();
        }
      }
      // The last one sees every error stored before the others' decrements.
      if (state->remaining.fetch_sub(1) == 1) {
        if (state->firstError) {
          state->all->setError(state->firstError);
        } else {
          state->all->markCompleted(c10::IValue());
        }
      }
    });
  }
  return state->all;
}

// A future that has already completed with `value`.
template <typename T>
Future<T> makeReadyFuture(T value) {
  auto impl = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  impl->markCompleted(detail::toIValue(std::move(value)));
  return Future<T>(std::move(impl));
}

} // namespace rpc
} // namespace torchrpc
