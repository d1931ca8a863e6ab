#pragma once

// Private: what the RRef context keeps per RRef it owns and per fork it
// holds. See Note [RRef fork protocol] in rref/rref_context.h.

#include <ATen/core/ivalue.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "torchrpc/rref/rref_id.h"

namespace torchrpc {
namespace rref {
namespace detail {

// An RRef this worker owns. Local handles hold it (and so the value); the
// context's owner table holds it while forks refer to it (R5).
struct OwnerRecord {
  explicit OwnerRecord(RRefId id)
      : id(id),
        value(c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get())) {}

  const RRefId id;
  // Completes with the value, or with the error that creating it raised.
  // Creation and confirmation wait on it; uses of the value read current().
  const c10::intrusive_ptr<c10::ivalue::Future> value;

  // What uses of the value read: `value`, or the last replacement
  // (RRefContext::setLocalValue). Uses already running keep what they read.
  c10::intrusive_ptr<c10::ivalue::Future> current() const {
    std::lock_guard<std::mutex> guard(replacedMutex);
    return replaced ? replaced : value;
  }
  void replace(c10::IValue newValue) {
    auto ready = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
    ready->markCompleted(std::move(newValue));
    std::lock_guard<std::mutex> guard(replacedMutex);
    replaced = std::move(ready);
  }

  // Guarded by the context's mutex. Fork -> the worker holding it (the
  // forks of a lost worker go; RRefContext::workerLost).
  std::unordered_map<ForkId, int64_t, GlobalIdHash> forks;
  // Creation has started (a kRemote arrived, or the value is local).
  bool creating = false;
  bool inTable = false;

 private:
  mutable std::mutex replacedMutex;
  c10::intrusive_ptr<c10::ivalue::Future> replaced;
};

// A fork this worker holds as a user.
struct UserFork {
  UserFork(RRefId rref, ForkId fork, int64_t owner)
      : rref(rref),
        fork(fork),
        owner(owner) {}

  const RRefId rref;
  const ForkId fork;
  // -1 when remote() named a worker that does not exist.
  const int64_t owner;
  // Completes when the owner answered (registered the fork, or failed to).
  const c10::intrusive_ptr<c10::ivalue::Future> confirmation =
      c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  // Only on the creator: `confirmation` itself (kRemote is answered once the
  // value exists); its error is the creation error (G4). Set before the fork
  // is shared.
  c10::intrusive_ptr<c10::ivalue::Future> creation;
  // The owner answered: it registered the fork, or the creation or
  // registration failed (then `failed`). R4 waits for this.
  std::atomic<bool> confirmed{false};
  std::atomic<bool> failed{false};

  // Guarded by the context's mutex.
  bool handleAlive = true;
  size_t pendingChildren = 0;
  bool deleting = false;
  // The owner never heard of this fork (its kRemote was never sent): there
  // is nothing to delete there.
  bool unknownToOwner = false;
};

} // namespace detail
} // namespace rref
} // namespace torchrpc
