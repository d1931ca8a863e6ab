#pragma once

// Future helpers the autograd layer's files share.

#include <ATen/core/ivalue.h>

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

namespace torchrpc {
namespace autograd {
namespace detail {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

inline FuturePtr readyFuture(c10::IValue value = c10::IValue()) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  future->markCompleted(std::move(value));
  return future;
}

inline FuturePtr failedFuture(std::exception_ptr error) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  future->setError(std::move(error));
  return future;
}

// Completes once every one of `futures` has; with the first error, if any.
inline FuturePtr allOf(const std::vector<FuturePtr>& futures) {
  if (futures.empty()) {
    return readyFuture();
  }
  auto all = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  auto remaining = std::make_shared<std::atomic<size_t>>(futures.size());
  auto firstError = std::make_shared<std::exception_ptr>();
  auto errorMutex = std::make_shared<std::mutex>();
  for (const auto& future : futures) {
    future->addCallback(
        [all, remaining, firstError, errorMutex](c10::ivalue::Future& done) {
          if (done.hasError()) {
            std::lock_guard<std::mutex> guard(*errorMutex);
            if (!*firstError) {
              *firstError = done.exception_ptr();
            }
          }
          if (remaining->fetch_sub(1) == 1) {
            if (*firstError) {
              all->setError(*firstError);
            } else {
              all->markCompleted(c10::IValue());
            }
          }
        });
  }
  return all;
}

// Completes with the first error among `futures` as soon as it comes, or
// with their values (a list, in order) once all succeeded.
inline FuturePtr firstErrorOrAll(const std::vector<FuturePtr>& futures) {
  auto all = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  if (futures.empty()) {
    all->markCompleted(c10::impl::GenericList(c10::AnyType::get()));
    return all;
  }
  struct State {
    std::mutex mutex;
    size_t remaining = 0;
    bool finished = false;
  };
  auto state = std::make_shared<State>();
  state->remaining = futures.size();
  for (const auto& future : futures) {
    future->addCallback([all, state, futures](c10::ivalue::Future& done) {
      {
        std::lock_guard<std::mutex> guard(state->mutex);
        if (state->finished) {
          return;
        }
        if (!done.hasError() && --state->remaining > 0) {
          return;
        }
        state->finished = true;
      }
      if (done.hasError()) {
        all->setError(done.exception_ptr());
        return;
      }
      c10::impl::GenericList values(c10::AnyType::get());
      for (const auto& each : futures) {
        values.push_back(each->value());
      }
      all->markCompleted(values);
    });
  }
  return all;
}

} // namespace detail
} // namespace autograd
} // namespace torchrpc
