#pragma once

#include <cstdint>

namespace torchrpc {
namespace rref {

// The message kinds of the RRef layer, registered with the agent at
// start-up (rpc/ owns [1, 15]; rref/ takes [16, 31]). Their bodies are the
// messages of proto/rref/rref.proto; see Note [RRef fork protocol] in
// rref/rref_context.h.
constexpr uint32_t kRemoteKind = 16;
constexpr uint32_t kCallOnKind = 17;
constexpr uint32_t kFetchKind = 18;
constexpr uint32_t kForkNotifyKind = 19;
constexpr uint32_t kChildAcceptedKind = 20;
constexpr uint32_t kDeleteForkKind = 21;

} // namespace rref
} // namespace torchrpc
