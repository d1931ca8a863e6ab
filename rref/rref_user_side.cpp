#include "torchrpc/rref/rref_context.h"

// RRefContext, user side: creating RRefs, using them, and the forks this
// worker holds (confirmation, pending children, deletion).

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <mutex>

#include "proto/rref/rref.pb.h"
#include "torchrpc/rpc/log_level.h"
#include "torchrpc/rref/detail/context_internals.h"
#include "torchrpc/rref/detail/records.h"
#include "torchrpc/rref/rref_handle.h"

namespace torchrpc {
namespace rref {

// ---- creating RRefs ---------------------------------------------------------

c10::intrusive_ptr<RRefHandle> RRefContext::remote(
    const rpc::WorkerRef& to,
    const std::string& function,
    std::vector<c10::IValue> args,
    c10::TypePtr type,
    std::chrono::milliseconds timeout,
    const RRefHandle* receiver) {
  RRefId id = mintId();
  const rpc::WorkerInfo* target = nullptr;
  try {
    target = &agent_.resolve(to);
  } catch (const c10::Error&) {
    // Fails like a call to an unknown worker: as the RRef's creation error.
    auto fork = std::make_shared<UserFork>(id, mintId(), -1);
    fork->creation = fork->confirmation;
    fork->creation->setError(rpc::makeRpcError(
        ErrorCode::kWorkerUnavailable,
        to.describe(),
        function,
        0,
        "no such worker in this job"));
    fork->confirmed = true;
    fork->failed = true;
    fork->unknownToOwner = true;
    return c10::make_intrusive<RRefHandle>(
        weak_from_this(),
        rpc::WorkerInfo{to.describe(), -1},
        std::move(type),
        std::move(fork));
  }

  if (target->id == self_.id) {
    auto record = std::make_shared<OwnerRecord>(id);
    record->creating = true;
    FuturePtr result;
    RuntimeUse use(*this);
    if (!use) {
      result = failedFuture(rpc::makeRpcError(
          ErrorCode::kShuttingDown,
          self_.name,
          function,
          0,
          "the runtime has shut down"));
    } else if (receiver != nullptr) {
      result = invokeOnValue(receiver->record()->current(), function, args);
    } else {
      result = runtime_.invokeLocal(function, std::move(args));
    }
    std::weak_ptr<RRefContext> weak = weak_from_this();
    result->addCallback([weak, record](c10::ivalue::Future& done) {
      if (auto self = weak.lock()) {
        self->settleRecord(record, done);
      } else if (!record->value->completed()) {
        completeFrom(done, *record->value);
      }
    });
    return c10::make_intrusive<RRefHandle>(
        weak_from_this(),
        *target,
        std::move(type),
        std::move(record));
  }

  std::shared_ptr<UserFork> fork;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    fork = addUserForkLocked(id, mintId(), target->id, /*confirmed=*/false);
    fork->creation = fork->confirmation;
  }
  wire::RemoteRequest message;
  toWire(id, message.mutable_rref());
  toWire(fork->fork, message.mutable_fork());
  message.set_function(function);
  c10::intrusive_ptr<RRefHandle> receiverHandle;
  if (receiver != nullptr) {
    toWire(receiver->id(), message.mutable_receiver());
    // The receiver's fork must outlive the kRemote that names it.
    receiverHandle = c10::intrusive_ptr<RRefHandle>::reclaim_copy(
        const_cast<RRefHandle*>(receiver));
  }
  auto reply = send(
      target->id,
      kRemoteKind,
      serialize(message),
      std::move(args),
      function,
      timeout);
  std::weak_ptr<RRefContext> weak = weak_from_this();
  reply->addCallback(
      [weak, fork, receiverHandle](c10::ivalue::Future& done) mutable {
        std::exception_ptr error;
        bool neverSent = false;
        if (done.hasError()) {
          error = done.exception_ptr();
          try {
            std::rethrow_exception(error);
          } catch (const RpcError& e) {
            // Message id 0: the agent refused it before it left.
            neverSent = e.messageId() == 0;
          } catch (...) {
          }
        }
        receiverHandle.reset();
        if (auto self = weak.lock()) {
          self->forkConfirmed(fork, error, neverSent);
        } else if (error) {
          fork->confirmation->setError(error);
        } else {
          fork->confirmation->markCompleted(c10::IValue());
        }
      });
  return c10::make_intrusive<RRefHandle>(
      weak_from_this(),
      *target,
      std::move(type),
      std::move(fork));
}

c10::intrusive_ptr<RRefHandle> RRefContext::makeOwned(
    c10::IValue value,
    c10::TypePtr type) {
  auto record = std::make_shared<OwnerRecord>(mintId());
  record->creating = true;
  record->value->markCompleted(std::move(value));
  return c10::make_intrusive<RRefHandle>(
      weak_from_this(),
      self_,
      std::move(type),
      std::move(record));
}

// ---- using RRefs ------------------------------------------------------------

namespace {

// Keeps `handle` (and so its fork) alive until `future` completes: a
// deletion must not overtake a message that names the fork. For a use, that
// is its request's answer, not the use's result: the result can fail first
// with the creation's error (preferCreationError), and a kDeleteFork sent
// then could overtake the request, which would make the owner a record no
// one deletes (R6). Until the creation is answered R4 keeps the fork anyway.
FuturePtr keepAliveUntilDone(
    FuturePtr future,
    c10::intrusive_ptr<RRefHandle> handle) {
  if (!future->completed()) {
    future->addCallback(
        [handle](c10::ivalue::Future&) mutable { handle.reset(); });
  }
  return future;
}

// A use of a creator's fork that ends after its creation failed fails with
// the creation error too (G4), even if the owner produced the value late. A
// use that fails while the creation is still unanswered waits for that
// answer: the owner answers uses of a failed creation with its record of the
// failure, which can overtake the creation's own answer, and once a use has
// failed, later uses and sends of the fork must see the creation error.
FuturePtr preferCreationError(
    const std::shared_ptr<UserFork>& fork,
    FuturePtr reply) {
  if (!fork->creation || fork->creation->completed()) {
    return reply;
  }
  struct State {
    std::mutex mutex;
    bool settled = false;
    bool replyFailed = false;
  };
  auto out = newFuture();
  auto state = std::make_shared<State>();
  fork->creation->addCallback(
      [out, state, reply](c10::ivalue::Future& creation) {
        {
          std::lock_guard<std::mutex> guard(state->mutex);
          if (state->settled || (!creation.hasError() && !state->replyFailed)) {
            return;
          }
          state->settled = true;
        }
        if (creation.hasError()) {
          out->setError(creation.exception_ptr());
        } else {
          completeFrom(*reply, *out); // the use's own failure
        }
      });
  reply->addCallback([fork, out, state](c10::ivalue::Future& done) {
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> guard(state->mutex);
      if (state->settled) {
        return;
      }
      error = creationError(*fork);
      if (!error && done.hasError() && !fork->creation->completed()) {
        state->replyFailed = true; // settled by the creation's answer
        return;
      }
      state->settled = true;
    }
    if (error) {
      out->setError(error);
    } else {
      completeFrom(done, *out);
    }
  });
  return out;
}

c10::intrusive_ptr<RRefHandle> retain(const RRefHandle& handle) {
  return c10::intrusive_ptr<RRefHandle>::reclaim_copy(
      const_cast<RRefHandle*>(&handle));
}

} // namespace

FuturePtr RRefContext::toHere(
    const RRefHandle& handle,
    std::chrono::milliseconds timeout) {
  if (handle.isOwner()) {
    auto out = newFuture();
    std::string selfName = self_.name;
    handle.record()->current()->addCallback(
        [out, selfName](c10::ivalue::Future& value) {
          if (value.hasError()) {
            out->setError(value.exception_ptr());
            return;
          }
          try {
            out->markCompleted(value.value().deepcopy());
          } catch (...) {
            out->setError(rpc::makeRpcError(
                ErrorCode::kBadArguments,
                selfName,
                "RRef.toHere",
                0,
                "the value cannot be copied: " +
                    rpc::describeException(std::current_exception())));
          }
        });
    return out;
  }
  const auto& fork = handle.fork();
  if (auto error = creationError(*fork)) {
    return failedFuture(error);
  }
  wire::FetchRequest message;
  toWire(fork->rref, message.mutable_rref());
  return preferCreationError(
      fork,
      keepAliveUntilDone(
          send(
              fork->owner,
              kFetchKind,
              serialize(message),
              {},
              "RRef.toHere",
              timeout),
          retain(handle)));
}

FuturePtr RRefContext::callOn(
    const RRefHandle& handle,
    const std::string& function,
    std::vector<c10::IValue> args,
    std::chrono::milliseconds timeout) {
  if (handle.isOwner()) {
    RuntimeUse use(*this);
    if (!use) {
      return failedFuture(rpc::makeRpcError(
          ErrorCode::kShuttingDown,
          self_.name,
          function,
          0,
          "the runtime has shut down"));
    }
    return invokeOnValue(handle.record()->current(), function, std::move(args));
  }
  const auto& fork = handle.fork();
  if (auto error = creationError(*fork)) {
    return failedFuture(error);
  }
  wire::CallOnRequest message;
  toWire(fork->rref, message.mutable_rref());
  message.set_function(function);
  return preferCreationError(
      fork,
      keepAliveUntilDone(
          send(
              fork->owner,
              kCallOnKind,
              serialize(message),
              std::move(args),
              function,
              timeout),
          retain(handle)));
}

FuturePtr RRefContext::confirmation(const RRefHandle& handle) {
  return handle.isOwner() ? handle.record()->value
                          : handle.fork()->confirmation;
}

c10::IValue RRefContext::localValue(const RRefHandle& handle) {
  TORCH_CHECK(
      handle.isOwner(),
      "localValue() on '",
      self_.name,
      "': ",
      describe(handle.id()),
      " is owned by '",
      handle.ownerName(),
      "'; use toHere() for a copy");
  const auto value = handle.record()->current();
  value->wait();
  if (value->hasError()) {
    std::rethrow_exception(value->exception_ptr());
  }
  return value->value();
}

void RRefContext::setLocalValue(const RRefHandle& handle, c10::IValue value) {
  TORCH_CHECK(
      handle.isOwner(),
      "setLocalValue() on '",
      self_.name,
      "': ",
      describe(handle.id()),
      " is owned by '",
      handle.ownerName(),
      "'");
  const auto& created = handle.record()->value;
  TORCH_CHECK(
      created->completed() && !created->hasError(),
      "setLocalValue() on '",
      self_.name,
      "': ",
      describe(handle.id()),
      created->completed() ? " failed to be created" : " is not created yet");
  handle.record()->replace(std::move(value));
}

FuturePtr RRefContext::invokeOnValue(
    const FuturePtr& value,
    const std::string& function,
    std::vector<c10::IValue> args) {
  auto out = newFuture();
  std::weak_ptr<RRefContext> weak = weak_from_this();
  value->addCallback([weak, function, args = std::move(args), out](
                         c10::ivalue::Future& ready) mutable {
    if (ready.hasError()) {
      out->setError(ready.exception_ptr());
      return;
    }
    auto self = weak.lock();
    if (!self) {
      out->setError(rpc::makeRpcError(
          ErrorCode::kShuttingDown,
          "",
          function,
          0,
          "the runtime is gone"));
      return;
    }
    RuntimeUse use(*self);
    if (!use) {
      out->setError(rpc::makeRpcError(
          ErrorCode::kShuttingDown,
          self->self_.name,
          function,
          0,
          "the runtime has shut down"));
      return;
    }
    std::vector<c10::IValue> all;
    all.reserve(args.size() + 1);
    all.push_back(ready.value());
    for (auto& arg : args) {
      all.push_back(std::move(arg));
    }
    auto result = self->runtime_.invokeLocal(function, std::move(all));
    result->addCallback(
        [out](c10::ivalue::Future& done) { completeFrom(done, *out); });
  });
  return out;
}

// ---- user tables
// ----------------------------------------------------------------

std::shared_ptr<UserFork> RRefContext::addUserForkLocked(
    const RRefId& rref,
    const ForkId& fork,
    int64_t owner,
    bool confirmed) {
  auto userFork = std::make_shared<UserFork>(rref, fork, owner);
  userFork->confirmed = confirmed;
  if (confirmed) {
    // Nothing can wait on it yet, so completing it runs no callback here.
    userFork->confirmation->markCompleted(c10::IValue());
  } else {
    ++pendingConfirmations_;
  }
  userForks_.emplace(fork, userFork);
  return userFork;
}

void RRefContext::forkConfirmed(
    const std::shared_ptr<UserFork>& fork,
    std::exception_ptr error,
    bool neverSent) {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    fork->unknownToOwner = fork->unknownToOwner || neverSent;
    fork->failed = error != nullptr;
    if (!fork->confirmed.exchange(true) && userForks_.count(fork->fork)) {
      --pendingConfirmations_;
    }
  }
  if (!fork->creation && error) {
    TORCHRPC_LOG(kWarning) << self_.name << ": the owner did not register fork "
                           << fork->fork.toString() << " of "
                           << describe(fork->rref) << ": "
                           << rpc::describeException(error);
  }
  if (error) {
    fork->confirmation->setError(error);
  } else {
    fork->confirmation->markCompleted(c10::IValue());
  }
  maybeDeleteFork(fork);
}

void RRefContext::userHandleGone(const std::shared_ptr<UserFork>& fork) {
  {
    std::lock_guard<std::mutex> guard(mutex_);
    fork->handleAlive = false;
  }
  maybeDeleteFork(fork);
}

void RRefContext::childAccepted(const ForkId& child) {
  std::shared_ptr<UserFork> parent;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = pendingChildren_.find(child);
    if (it == pendingChildren_.end()) {
      return;
    }
    parent = std::move(it->second.parent);
    pendingChildren_.erase(it);
    --parent->pendingChildren;
  }
  maybeDeleteFork(parent); // R7: before the acceptance is answered
}

void RRefContext::eraseUserFork(const ForkId& fork) {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = userForks_.find(fork);
  if (it == userForks_.end()) {
    return;
  }
  // Shutdown may give a fork back before its confirmation arrived.
  if (!it->second->confirmed) {
    --pendingConfirmations_;
  }
  userForks_.erase(it);
  if (userForks_.empty()) {
    forksGone_.notify_all();
  }
}

void RRefContext::maybeDeleteFork(const std::shared_ptr<UserFork>& fork) {
  bool sendIt = false;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    // R4.
    if (fork->deleting || fork->handleAlive || fork->pendingChildren > 0 ||
        !fork->confirmed) {
      return;
    }
    fork->deleting = true;
    if (!fork->unknownToOwner) {
      sendIt = true;
    }
  }
  if (sendIt) {
    sendDelete(fork);
  } else {
    eraseUserFork(fork->fork);
  }
}

void RRefContext::sendDelete(const std::shared_ptr<UserFork>& fork) {
  std::vector<std::shared_ptr<UserFork>> batch;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    auto& queue = deletions_[fork->owner];
    if (queue.inFlight) {
      queue.queued.push_back(fork);
      return;
    }
    queue.inFlight = true;
  }
  batch.push_back(fork);
  sendDeleteBatch(fork->owner, std::move(batch));
}

void RRefContext::sendDeleteBatch(
    int64_t owner,
    std::vector<std::shared_ptr<UserFork>> batch) {
  wire::DeleteForks message;
  message.mutable_forks()->Reserve(static_cast<int>(batch.size()));
  for (const auto& fork : batch) {
    auto* entry = message.add_forks();
    toWire(fork->rref, entry->mutable_rref());
    toWire(fork->fork, entry->mutable_fork());
  }
  auto reply = send(
      owner,
      kDeleteForkKind,
      serialize(message),
      {},
      "rref.deleteFork",
      defaultTimeout());
  std::weak_ptr<RRefContext> weak = weak_from_this();
  reply->addCallback([weak, owner, batch = std::move(batch)](
                         c10::ivalue::Future& done) {
    auto self = weak.lock();
    if (!self) {
      return;
    }
    if (done.hasError()) {
      TORCHRPC_LOG(kDebug) << self->self_.name << ": deleting " << batch.size()
                           << " forks on worker " << owner << " failed: "
                           << rpc::describeException(done.exception_ptr());
    } else {
      TORCHRPC_LOG(kDebug) << self->self_.name << ": deleted " << batch.size()
                           << " forks on worker " << owner << " (first "
                           << batch.front()->fork.toString() << " of RRef "
                           << batch.front()->rref.toString() << ")";
    }
    for (const auto& fork : batch) {
      self->eraseUserFork(fork->fork);
    }
    // The deletions queued meanwhile go as one message.
    std::vector<std::shared_ptr<UserFork>> next;
    {
      std::lock_guard<std::mutex> guard(self->mutex_);
      auto& queue = self->deletions_[owner];
      size_t count = std::min(queue.queued.size(), kMaxForksPerDeletion);
      next.assign(queue.queued.begin(), queue.queued.begin() + count);
      queue.queued.erase(queue.queued.begin(), queue.queued.begin() + count);
      queue.inFlight = !next.empty();
    }
    if (!next.empty()) {
      self->sendDeleteBatch(owner, std::move(next));
    }
  });
}

} // namespace rref
} // namespace torchrpc
