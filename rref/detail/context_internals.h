#pragma once

// Private to rref/: what the files implementing RRefContext share.

#include <ATen/core/ivalue.h>

#include <atomic>
#include <mutex>
#include <string>

#include "proto/rref/rref.pb.h"
#include "torchrpc/rpc/agent.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/future.h"
#include "torchrpc/rref/detail/records.h"
#include "torchrpc/rref/rref_context.h"
#include "torchrpc/rref/rref_handle.h"

namespace torchrpc {
namespace rref {
namespace detail {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

inline void toWire(const GlobalId& id, wire::Id* out) {
  out->set_worker(id.worker);
  out->set_local(id.local);
}

template <typename M>
std::string serialize(const M& message) {
  std::string bytes;
  message.SerializeToString(&bytes);
  return bytes;
}

inline FuturePtr newFuture() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
}

inline std::string describe(const GlobalId& id) {
  return "RRef " + id.toString();
}
// The creation error of a user's fork, if creation failed (G4).
inline std::exception_ptr creationError(const UserFork& fork) {
  if (fork.creation && fork.creation->completed() &&
      fork.creation->hasError()) {
    return fork.creation->exception_ptr();
  }
  return nullptr;
}

} // namespace detail

// What the files implementing RRefContext use unqualified.
using detail::creationError;
using detail::describe;
using detail::FuturePtr;
using detail::newFuture;
using detail::OwnerRecord;
using detail::RRefHandle;
using detail::serialize;
using detail::toWire;
using detail::UserFork;
using rpc::completeFrom;
using rpc::ErrorCode;
using rpc::failedFuture;
using rpc::readyFuture;
using rpc::RpcError;

// Reads ids a peer sent: each must name a worker of the job.
class RRefContext::WireReader {
 public:
  WireReader(const rpc::Request& request, int64_t worldSize)
      : request_(request),
        worldSize_(worldSize) {}

  template <typename M>
  M parse() const {
    M message;
    if (!message.ParseFromString(request_.body)) {
      fail("its body does not parse");
    }
    return message;
  }

  GlobalId id(const wire::Id& id) const {
    workerId(id.worker());
    return GlobalId{id.worker(), id.local()};
  }

  int64_t workerId(int64_t worker) const {
    if (worker < 0 || worker >= worldSize_) {
      fail("it names worker " + std::to_string(worker));
    }
    return worker;
  }

  [[noreturn]] void fail(const std::string& why) const {
    throw rpc::RpcError(
        rpc::ErrorCode::kMalformedMessage,
        request_.from.name,
        "rref message kind " + std::to_string(request_.kind),
        request_.id,
        "malformed RRef message: " + why);
  }

 private:
  const rpc::Request& request_;
  int64_t worldSize_;
};

// Marks a use of the runtime: closed() waits until every use has ended, so
// nothing touches the agent or the registry once they are being torn down.
class RRefContext::RuntimeUse {
 public:
  explicit RuntimeUse(RRefContext& context) : context_(context) {
    std::lock_guard<std::mutex> guard(context_.mutex_);
    entered_ = !context_.closed_;
    if (entered_) {
      ++context_.runtimeUses_;
    }
  }
  ~RuntimeUse() {
    if (!entered_) {
      return;
    }
    std::lock_guard<std::mutex> guard(context_.mutex_);
    if (--context_.runtimeUses_ == 0) {
      context_.runtimeUsesDone_.notify_all();
    }
  }
  RuntimeUse(const RuntimeUse&) = delete;
  RuntimeUse& operator=(const RuntimeUse&) = delete;

  explicit operator bool() const {
    return entered_;
  }

 private:
  RRefContext& context_;
  bool entered_ = false;
};

} // namespace rref
} // namespace torchrpc
