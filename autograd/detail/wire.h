#pragma once

// Private to autograd/: building and reading the layer's messages (kinds in
// autograd/messages.h, bodies in proto/autograd/autograd.proto).

#include <google/protobuf/message_lite.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

#include "proto/autograd/autograd.pb.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/request.h"

namespace torchrpc {
namespace autograd {
namespace detail {

// What the layer's requests are labelled with in errors and logs.
constexpr const char* kBackwardWhat = "autograd.backward";
constexpr const char* kReleaseContextWhat = "autograd.releaseContext";

inline wire::PassRef passRef(int64_t contextId, int64_t passId) {
  wire::PassRef ref;
  ref.set_context_id(contextId);
  ref.set_pass_id(passId);
  return ref;
}

// A request of this layer: `kind`, with `body` (a serialized message).
inline rpc::OutgoingRequest layerRequest(
    uint32_t kind,
    std::string body,
    const char* what,
    std::chrono::milliseconds timeout) {
  rpc::OutgoingRequest request;
  request.kind = kind;
  request.body = std::move(body);
  request.what = what;
  request.timeout = timeout;
  return request;
}

// A message of the backward pass, of `kind`, carrying `message`.
inline rpc::OutgoingRequest passRequest(
    uint32_t kind,
    const google::protobuf::MessageLite& message,
    std::chrono::milliseconds timeout) {
  return layerRequest(
      kind,
      message.SerializeAsString(),
      kBackwardWhat,
      timeout);
}

// Refuses `request` as malformed: kMalformedMessage from its sender.
[[noreturn]] inline void throwMalformed(
    const rpc::Request& request,
    const char* what,
    const char* why) {
  throw rpc::RpcError(
      rpc::ErrorCode::kMalformedMessage,
      request.from.name,
      what,
      request.id,
      why);
}

// The body of `request` as a Message, or throws as throwMalformed does.
template <typename Message>
Message parseOrThrow(
    const rpc::Request& request,
    const char* what,
    const char* why = "malformed distributed backward message") {
  Message message;
  if (!message.ParseFromString(request.body)) {
    throwMalformed(request, what, why);
  }
  return message;
}

} // namespace detail
} // namespace autograd
} // namespace torchrpc
