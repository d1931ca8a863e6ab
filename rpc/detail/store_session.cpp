#include "torchrpc/rpc/detail/store_session.h"

#include <utility>
#include <vector>

#include "proto/rpc/store.pb.h"

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

std::vector<std::string> keysOf(
    const google::protobuf::RepeatedPtrField<std::string>& keys) {
  return std::vector<std::string>(keys.begin(), keys.end());
}

} // namespace

StoreSession::StoreSession(
    std::shared_ptr<StoreState> state,
    SendReply sendReply)
    : state_(std::move(state)),
      sendReply_(std::move(sendReply)) {}

std::string StoreSession::handle(const std::string& bytes) {
  store::StoreRequest request;
  if (!request.ParseFromString(bytes)) {
    return "a request that does not parse";
  }
  store::StoreReply reply;
  reply.set_id(request.id());
  switch (request.op_case()) {
    case store::StoreRequest::kSet:
      reply.set_error(state_->set(
          request.set().key(),
          std::move(*request.mutable_set()->mutable_value())));
      break;
    case store::StoreRequest::kGet: {
      auto value = state_->get(request.get().key());
      reply.set_found(value.has_value());
      if (value) {
        reply.set_value(std::move(*value));
      }
      break;
    }
    case store::StoreRequest::kAdd: {
      int64_t result = 0;
      reply.set_error(
          state_->add(request.add().key(), request.add().delta(), &result));
      reply.set_number(result);
      break;
    }
    case store::StoreRequest::kCheck:
      if (static_cast<size_t>(request.check().keys_size()) >
          state_->limits().maxKeysPerRequest) {
        reply.set_error("too many keys in one check");
      } else {
        reply.set_found(state_->check(keysOf(request.check().keys())));
      }
      break;
    case store::StoreRequest::kWait: {
      std::string error =
          startWait(request.id(), keysOf(request.wait().keys()));
      if (error.empty()) {
        return ""; // replied when the keys exist
      }
      reply.set_error(std::move(error));
      break;
    }
    case store::StoreRequest::kCancelWait:
      cancelWait(request.cancel_wait().wait_id());
      return ""; // no reply: the client stopped waiting
    case store::StoreRequest::OP_NOT_SET:
      return "a request without an operation";
  }
  sendReply_(reply.SerializeAsString());
  return "";
}

std::string StoreSession::startWait(
    uint64_t requestId,
    std::vector<std::string> keys) {
  const uint64_t waitId = state_->newWaitId();
  {
    std::lock_guard<std::mutex> guard(mutex_);
    if (closed_ || waits_.count(requestId) > 0) {
      return "wait id " + std::to_string(requestId) +
          " is already pending on this connection";
    }
    waits_.emplace(requestId, waitId);
  }
  std::weak_ptr<StoreSession> weak = weak_from_this();
  std::string error =
      state_->wait(waitId, std::move(keys), [weak, requestId]() {
        auto self = weak.lock();
        if (!self) {
          return;
        }
        {
          std::lock_guard<std::mutex> guard(self->mutex_);
          if (self->waits_.erase(requestId) == 0) {
            return; // cancelled meanwhile, or the client went away
          }
        }
        store::StoreReply reply;
        reply.set_id(requestId);
        reply.set_found(true);
        self->sendReply_(reply.SerializeAsString());
      });
  if (!error.empty()) {
    std::lock_guard<std::mutex> guard(mutex_);
    waits_.erase(requestId);
  }
  return error;
}

void StoreSession::cancelWait(uint64_t requestId) {
  uint64_t waitId = 0;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = waits_.find(requestId);
    if (it == waits_.end()) {
      return;
    }
    waitId = it->second;
    waits_.erase(it);
  }
  state_->cancelWait(waitId);
}

void StoreSession::close() {
  std::unordered_map<uint64_t, uint64_t> waits;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    closed_ = true;
    waits.swap(waits_);
  }
  for (const auto& wait : waits) {
    state_->cancelWait(wait.second);
  }
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
