#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace torchrpc {
namespace rref {

// Names an RRef, or one fork (one reference held by one user), across the
// job: the id of the worker that minted it and a counter of that worker.
struct GlobalId {
  int64_t worker = -1;
  uint64_t local = 0;

  bool operator==(const GlobalId& other) const {
    return worker == other.worker && local == other.local;
  }
  bool operator!=(const GlobalId& other) const {
    return !(*this == other);
  }
  std::string toString() const {
    return std::to_string(worker) + ":" + std::to_string(local);
  }
};

using RRefId = GlobalId;
using ForkId = GlobalId;

struct GlobalIdHash {
  size_t operator()(const GlobalId& id) const {
    return std::hash<uint64_t>()(id.local * 0x9E3779B97F4A7C15ull) ^
        std::hash<int64_t>()(id.worker);
  }
};

} // namespace rref
} // namespace torchrpc
