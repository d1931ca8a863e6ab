#pragma once

// The message hook extension point: how an upper layer sees every message's
// tensors and attaches metadata (autograd records send/recv edges with it).

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "torchrpc/rpc/request_scope.h"
#include "torchrpc/rpc/worker_info.h"

namespace torchrpc {
namespace rpc {

// What a hook knows of the message it sees.
struct HookContext {
  const WorkerInfo& peer;
  uint32_t kind;
  uint64_t messageId;
  bool isResponse;
  // For a response: the request it answers, if that carried metadata.
  const RequestScope* request;
};

// Lets an upper layer see every message's tensors and attach metadata, e.g.
// to record autograd send/recv edges. onSend runs on the sending thread once
// the values are encoded; `tensors` are the original tensors, in wire order.
// Whatever it writes into *metadata travels under the hook's name (nothing
// travels if it stays empty). onReceive runs before values are decoded, on
// a pool thread or, for a response completed where it is read (Note [Where
// messages are handled] in agent.cpp), on the transport's or a waiting
// caller's thread, so it must not block; it may replace tensors (keeping
// the count); metadata is
// nullptr when the sender attached none. A hook that throws fails that
// message (kInternal on send, kMalformedMessage on receive).
struct MessageHook {
  std::string name;
  std::function<void(
      const HookContext& context,
      const std::vector<at::Tensor>& tensors,
      std::string* metadata)>
      onSend;
  std::function<void(
      const HookContext& context,
      std::vector<at::Tensor>& tensors,
      const std::string* metadata)>
      onReceive;
};

} // namespace rpc
} // namespace torchrpc
