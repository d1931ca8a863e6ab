#include "torchrpc/rref/rref_context.h"

// RRefContext, owner side: the handlers of the rref/ message kinds and the
// owner table (records, forks, tombstones).

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include "proto/rref/rref.pb.h"
#include "torchrpc/rref/detail/context_internals.h"
#include "torchrpc/rref/detail/records.h"
#include "torchrpc/rref/rref_handle.h"

namespace torchrpc {
namespace rref {

// ---- handlers (owner side, but kChildAccepted) ------------------------------

FuturePtr RRefContext::onRemote(rpc::Request&& request) {
  WireReader reader(request, static_cast<int64_t>(agent_.workers().size()));
  auto message = reader.parse<wire::RemoteRequest>();
  RRefId rref = reader.id(message.rref());
  ForkId fork = reader.id(message.fork());
  if (rref.worker != request.from.id || fork.worker != request.from.id) {
    reader.fail("the creator did not mint its ids");
  }
  const bool hasReceiver = message.has_receiver();
  const RRefId receiverId = hasReceiver ? reader.id(message.receiver()) : rref;
  std::shared_ptr<OwnerRecord> record;
  std::shared_ptr<OwnerRecord> receiver;
  bool gaveUp = false;
  bool receiverDeleted = false;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    record = recordLocked(rref);
    if (record->creating) {
      reader.fail(describe(rref) + " is being created already");
    }
    record->creating = true;
    gaveUp = takeTombstoneLocked(rref, fork);
    if (!gaveUp) {
      record->forks.emplace(fork, request.from.id);
      if (hasReceiver) {
        // A use of the receiver, which may come late as kFetch does (R6).
        receiverDeleted = lateUseLocked(receiverId);
        if (!receiverDeleted) {
          receiver = recordLocked(receiverId);
        }
      }
    }
  }
  FuturePtr result;
  if (receiverDeleted) {
    // The new RRef fails and is dropped once its creator lets it go.
    result =
        failedFuture(lateUseError(receiverId, request, message.function()));
  } else if (gaveUp) {
    // R6: the creator deleted its fork before this arrived.
    result = failedFuture(rpc::makeRpcError(
        ErrorCode::kTimeout,
        self_.name,
        message.function(),
        request.id,
        "the creator of " + describe(rref) +
            " gave up on it before its creation arrived"));
  } else if (receiver) {
    result = invokeOnValue(
        receiver->current(),
        message.function(),
        std::move(request.values));
  } else {
    result =
        runtime_.invokeLocal(message.function(), std::move(request.values));
  }
  // Answered once the value exists, so that a failure reaches the creator.
  auto reply = newFuture();
  std::weak_ptr<RRefContext> weak = weak_from_this();
  result->addCallback([weak, record, reply](c10::ivalue::Future& done) {
    if (auto self = weak.lock()) {
      self->settleRecord(record, done);
    }
    if (done.hasError()) {
      reply->setError(done.exception_ptr());
    } else {
      reply->markCompleted(c10::IValue());
    }
  });
  return reply;
}

FuturePtr RRefContext::onCallOn(rpc::Request&& request) {
  WireReader reader(request, static_cast<int64_t>(agent_.workers().size()));
  auto message = reader.parse<wire::CallOnRequest>();
  RRefId rref = reader.id(message.rref());
  std::shared_ptr<OwnerRecord> record;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    record = recordForUseLocked(rref, request, "rref.callOn"); // R6
  }
  return invokeOnValue(
      record->current(),
      message.function(),
      std::move(request.values));
}

FuturePtr RRefContext::onFetch(rpc::Request&& request) {
  WireReader reader(request, static_cast<int64_t>(agent_.workers().size()));
  auto message = reader.parse<wire::FetchRequest>();
  RRefId rref = reader.id(message.rref());
  std::shared_ptr<OwnerRecord> record;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    record = recordForUseLocked(rref, request, "rref.fetch"); // R6
  }
  // The response is the copy: the codec writes the value's bytes.
  return record->current();
}

FuturePtr RRefContext::onForkNotify(rpc::Request&& request) {
  WireReader reader(request, static_cast<int64_t>(agent_.workers().size()));
  auto message = reader.parse<wire::ForkNotify>();
  RRefId rref = reader.id(message.rref());
  ForkId fork = reader.id(message.fork());
  int64_t parent = reader.workerId(message.parent());
  if (parent == self_.id || fork.worker != parent) {
    reader.fail(
        "fork " + fork.toString() + " cannot come from " +
        std::to_string(parent));
  }
  {
    std::lock_guard<std::mutex> guard(mutex_);
    // A tombstone: the holder already gave the fork up (after its notify
    // timed out); registering it now would leak.
    if (!takeTombstoneLocked(rref, fork)) {
      recordLocked(rref)->forks.emplace(fork, request.from.id);
    }
  }
  // R2, R7: the parent hears of it before the notify is answered.
  wire::ChildAccepted accepted;
  toWire(fork, accepted.mutable_fork());
  send(
      parent,
      kChildAcceptedKind,
      serialize(accepted),
      {},
      "rref.childAccepted",
      defaultTimeout());
  return readyFuture();
}

FuturePtr RRefContext::onChildAccepted(rpc::Request&& request) {
  WireReader reader(request, static_cast<int64_t>(agent_.workers().size()));
  auto message = reader.parse<wire::ChildAccepted>();
  childAccepted(reader.id(message.fork()));
  return readyFuture();
}

FuturePtr RRefContext::onDeleteFork(rpc::Request&& request) {
  WireReader reader(request, static_cast<int64_t>(agent_.workers().size()));
  auto message = reader.parse<wire::DeleteForks>();
  std::vector<std::pair<RRefId, ForkId>> forks;
  forks.reserve(message.forks_size());
  for (const auto& entry : message.forks()) {
    forks.emplace_back(reader.id(entry.rref()), reader.id(entry.fork()));
  }
  std::vector<std::shared_ptr<OwnerRecord>> dropped;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    for (const auto& [rref, fork] : forks) {
      auto it = owned_.find(rref);
      if (it == owned_.end() || it->second->forks.erase(fork) == 0) {
        addTombstoneLocked(rref, fork); // R6
      } else {
        maybeDropRecordLocked(it->second, &dropped);
      }
    }
  }
  // `dropped` (and maybe values) are freed here, outside the lock.
  return readyFuture();
}

// ---- owner tables
// -------------------------------------------------------------

std::shared_ptr<OwnerRecord> RRefContext::recordLocked(const RRefId& id) {
  auto& slot = owned_[id];
  if (!slot) {
    slot = std::make_shared<OwnerRecord>(id);
    slot->inTable = true;
  }
  return slot;
}

bool RRefContext::lateUseLocked(const RRefId& id) {
  if (owned_.count(id) != 0 || droppedIds_.count(id) == 0) {
    return false;
  }
  ++lateUses_;
  return true;
}

std::exception_ptr RRefContext::lateUseError(
    const RRefId& id,
    const rpc::Request& request,
    const std::string& what) const {
  // The owner held no fork of it any more: the caller had given up on this
  // use (a timeout), or the fork was a lost worker's (G6).
  return rpc::makeRpcError(
      ErrorCode::kBadArguments,
      self_.name,
      what,
      request.id,
      describe(id) + " was deleted here before this use arrived: its owner " +
          "held no fork of it any more");
}

std::shared_ptr<OwnerRecord> RRefContext::recordForUseLocked(
    const RRefId& id,
    const rpc::Request& request,
    const char* what) {
  auto it = owned_.find(id);
  if (it != owned_.end()) {
    return it->second; // the common case: one lookup
  }
  if (lateUseLocked(id)) {
    std::rethrow_exception(lateUseError(id, request, what));
  }
  return recordLocked(id); // pending: waits for the value (R6)
}

void RRefContext::maybeDropRecordLocked(
    const std::shared_ptr<OwnerRecord>& record,
    std::vector<std::shared_ptr<OwnerRecord>>* dropped) {
  if (record->inTable && record->forks.empty() && record->value->completed()) {
    record->inTable = false;
    // `record` may be the table's own pointer, moved out below.
    const RRefId id = record->id;
    auto it = owned_.find(id);
    dropped->push_back(std::move(it->second));
    owned_.erase(it);
    // R6: remembered so that a late use is refused. An owner's local handle
    // may put the record back when it sends the RRef again (then the table
    // is asked first).
    if (droppedIds_.insert(id).second) {
      droppedOrder_.push_back(id);
      if (droppedOrder_.size() > kMaxTombstones) {
        droppedIds_.erase(droppedOrder_.front());
        droppedOrder_.pop_front();
      }
    }
  }
}

void RRefContext::settleRecord(
    const std::shared_ptr<OwnerRecord>& record,
    c10::ivalue::Future& result) {
  if (!record->value->completed()) {
    completeFrom(result, *record->value);
  }
  std::vector<std::shared_ptr<OwnerRecord>> dropped;
  std::lock_guard<std::mutex> guard(mutex_);
  maybeDropRecordLocked(record, &dropped);
  // NB: `record` is still held by the caller, so nothing is freed here.
}

void RRefContext::addTombstoneLocked(const RRefId& rref, const ForkId& fork) {
  if (tombstones_.size() >= kMaxTombstones) {
    tombstones_.pop_front();
  }
  tombstones_.emplace_back(rref, fork);
}

bool RRefContext::takeTombstoneLocked(const RRefId& rref, const ForkId& fork) {
  for (auto it = tombstones_.begin(); it != tombstones_.end(); ++it) {
    if (it->first == rref && it->second == fork) {
      tombstones_.erase(it);
      return true;
    }
  }
  return false;
}

} // namespace rref
} // namespace torchrpc
