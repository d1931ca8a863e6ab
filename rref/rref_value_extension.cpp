#include "torchrpc/rref/rref_context.h"

// RRefContext: RRefs inside values. Encoding forks a reference (R1);
// decoding adopts one (R2, R3).

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include "proto/rref/rref.pb.h"
#include "torchrpc/rref/detail/context_internals.h"
#include "torchrpc/rref/detail/records.h"
#include "torchrpc/rref/rref_handle.h"

namespace torchrpc {
namespace rref {

// ---- the value extension
// ------------------------------------------------------

void RRefContext::encodeRRef(
    const c10::IValue& value,
    int64_t toWorker,
    std::string* payload,
    std::vector<c10::IValue>* nested) {
  auto handle = detail::handleOf(value);
  if (!handle) {
    throw RpcError(
        ErrorCode::kBadArguments,
        "",
        "",
        0,
        "cannot send an RRef that torchrpc did not create");
  }
  if (!handle->belongsTo(this)) {
    throw RpcError(
        ErrorCode::kBadArguments,
        "",
        "",
        0,
        "cannot send " + describe(handle->id()) +
            ": it belongs to another runtime than '" + self_.name + "'");
  }
  ForkId fork = mintId();
  if (handle->isOwner()) {
    // R1: registered before it leaves.
    const auto& record = handle->record();
    std::lock_guard<std::mutex> guard(mutex_);
    record->forks.emplace(fork, toWorker);
    if (!record->inTable) {
      record->inTable = true;
      owned_.emplace(record->id, record);
    }
  } else {
    const auto& parent = handle->fork();
    if (auto error = creationError(*parent)) {
      throw RpcError(
          ErrorCode::kBadArguments,
          "",
          "",
          0,
          "cannot send " + describe(parent->rref) +
              ": creating it failed: " + rpc::describeException(error));
    }
    // R1: the parent's fork stays until the owner registered this one.
    std::lock_guard<std::mutex> guard(mutex_);
    ++parent->pendingChildren;
    pendingChildren_.emplace(fork, PendingChild{parent, toWorker});
  }
  wire::RRefValue message;
  toWire(handle->id(), message.mutable_rref());
  toWire(fork, message.mutable_fork());
  message.set_owner(handle->ownerInfo().id);
  message.SerializeToString(payload);
  // An empty list typed with the value's type carries the type, through the
  // codec's own (checked) type encoding.
  nested->push_back(c10::impl::GenericList(handle->type()));
}

c10::IValue RRefContext::decodeRRef(
    int64_t fromWorker,
    const std::string& payload,
    std::vector<c10::IValue>&& nested) {
  wire::RRefValue message;
  TORCH_CHECK(message.ParseFromString(payload), "the payload does not parse");
  const auto& workers = agent_.workers();
  auto checkWorker = [&](int64_t worker) {
    TORCH_CHECK(
        worker >= 0 && worker < static_cast<int64_t>(workers.size()),
        "it names worker ",
        worker);
    return worker;
  };
  RRefId rref{checkWorker(message.rref().worker()), message.rref().local()};
  ForkId fork{checkWorker(message.fork().worker()), message.fork().local()};
  int64_t owner = checkWorker(message.owner());
  // The sender mints the fork it sends.
  TORCH_CHECK(fork.worker == fromWorker, "a fork minted by another worker");
  TORCH_CHECK(
      nested.size() == 1 && nested[0].isList(),
      "the value type is missing");
  c10::TypePtr type = nested[0].toList().elementType();

  if (owner == self_.id) {
    std::shared_ptr<OwnerRecord> record;
    std::vector<std::shared_ptr<OwnerRecord>> dropped;
    {
      std::lock_guard<std::mutex> guard(mutex_);
      // Pending if its kRemote has not arrived yet (R6).
      record = recordLocked(rref);
      if (fromWorker == self_.id) {
        // R3: our own reference came back; the new handle holds the value.
        record->forks.erase(fork);
        maybeDropRecordLocked(record, &dropped);
      }
    }
    if (fromWorker != self_.id) {
      // R3 (and R7: sent before the message carrying it is answered).
      wire::ChildAccepted accepted;
      toWire(fork, accepted.mutable_fork());
      send(
          fromWorker,
          kChildAcceptedKind,
          serialize(accepted),
          {},
          "rref.childAccepted",
          defaultTimeout());
    }
    return c10::IValue(
        c10::intrusive_ptr<c10::RRefInterface>(c10::make_intrusive<RRefHandle>(
            weak_from_this(),
            self_,
            std::move(type),
            std::move(record))));
  }

  std::shared_ptr<UserFork> userFork;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    TORCH_CHECK(
        userForks_.count(fork) == 0,
        "fork ",
        fork.toString(),
        " is already held here");
    userFork = addUserForkLocked(
        rref,
        fork,
        owner,
        /*confirmed=*/fromWorker == owner);
  }
  if (fromWorker != owner) {
    // R2.
    wire::ForkNotify notify;
    toWire(rref, notify.mutable_rref());
    toWire(fork, notify.mutable_fork());
    notify.set_parent(fromWorker);
    auto reply = send(
        owner,
        kForkNotifyKind,
        serialize(notify),
        {},
        "rref.forkNotify",
        defaultTimeout());
    std::weak_ptr<RRefContext> weak = weak_from_this();
    reply->addCallback([weak, userFork](c10::ivalue::Future& done) {
      if (auto self = weak.lock()) {
        self->forkConfirmed(
            userFork,
            done.hasError() ? done.exception_ptr() : nullptr,
            /*neverSent=*/false);
      }
    });
  }
  return c10::IValue(
      c10::intrusive_ptr<c10::RRefInterface>(c10::make_intrusive<RRefHandle>(
          weak_from_this(),
          workers[owner],
          std::move(type),
          std::move(userFork))));
}

} // namespace rref
} // namespace torchrpc
