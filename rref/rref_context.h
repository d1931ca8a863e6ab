#pragma once

#include <ATen/core/ivalue.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rpc/runtime_layer.h"
#include "torchrpc/rref/messages.h"
#include "torchrpc/rref/rref_id.h"

namespace torchrpc {
namespace rref {

// Note [RRef fork protocol]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Background: an RRef names a value that lives on its owner. Every reference
// a user (any other worker) holds is a *fork* with a job-unique ForkId. The
// owner keeps, per RRef, the set of forks it knows of; a user keeps, per
// fork it holds, whether the owner has confirmed it and how many forks it
// has handed on that the owner has not registered yet (pending children).
// A worker holds at most one handle object per fork; copies of an RRef<T>
// share it, and the fork is given up when the last copy is gone.
//
// Assumptions: messages between two workers may arrive in any order (a
// worker has several connections and handles messages on a pool), but every
// message sent to a live worker arrives once. Any worker may fail.
//
// Messages: kRemote (creator -> owner: create the value, register the
// creator's fork; answered once the value exists or failed), kCallOn and
// kFetch (run a function on the value, copy it), kForkNotify (a user ->
// owner: "I hold fork f, sent to me by P"), kChildAccepted (owner -> P: "f
// is registered"), kDeleteFork (user -> owner: "I no longer hold f"; one in
// flight per owner, the ones that wait meanwhile go together).
//
// Rules:
//  R1. Sending a reference mints a new fork f. An owner adds f to its set
//      before it sends; a user P records f as a pending child of the fork it
//      holds.
//  R2. A user that receives f from a user P sends kForkNotify; the owner
//      adds f, sends kChildAccepted(f) to P, and only then answers the
//      notify, which confirms f. A fork received from the owner is confirmed
//      on arrival (R1 registered it).
//  R3. An owner that receives f from a user P sends kChildAccepted(f) to P:
//      the reference became a local handle, which holds the value itself. If
//      the owner sent it to itself, it removes f from its set again.
//  R4. A user sends kDeleteFork(f) only when no handle of f is left, f is
//      confirmed (or its creation failed), and f has no pending children.
//  R5. The owner drops its record of an RRef when the fork set is empty and
//      the value is settled (created or failed); a local handle on the owner
//      keeps the value itself alive for as long as it lives.
//  R6. A message may come before the record it names: kForkNotify, kFetch
//      and kCallOn for an unknown RRef create a pending record (kCallOn and
//      kFetch wait for the value); a kDeleteFork for a fork the owner does
//      not know leaves a tombstone, and the late kRemote that finds it does
//      not run (the creator gave up on it after a timeout). A message may
//      also come after its record was dropped: a use keeps its fork only
//      until it is answered or times out, so a use whose caller stopped
//      waiting can arrive after the last fork's deletion (and a kRemote
//      with a receiver after the receiver's). The owner remembers the RRefs
//      whose records it dropped, and refuses kFetch and kCallOn naming one,
//      and fails the RRef a kRemote creates from one (kBadArguments),
//      instead of making a pending record that no deletion would remove.
//  R7. Every message a step causes is sent (or queued behind a deletion in
//      flight to the same owner) before the message that caused it is
//      answered, so until the protocol has settled some worker has a call in
//      flight.
//
// Guarantees:
//  G1. No early free: while a reference is held or in flight anywhere, its
//      owner has a record with a non-empty fork set, or a local handle on
//      the owner holds the value (R1-R4: a fork leaves the set only after
//      every fork handed on from it was registered).
//  G2. No leak: once every handle is gone and the messages have arrived,
//      every table on every worker is empty and the value is freed (R4, R5).
//  G3. Any order: G1 and G2 hold for every order of delivery (R6).
//  G4. Failures travel: if the function of remote() threw, or the kRemote
//      failed or timed out, every later use of the RRef on the creator fails
//      with that original error; other holders get the owner's record of
//      the failure. Sending an RRef whose creation failed fails that call.
//  G5. Graceful shutdown gives back every fork and ends with every table
//      empty on every worker; a user's handle used afterwards fails with
//      kShuttingDown (an owner's handle still holds its value).
//  G6. A lost worker (Note [Lost workers] in rpc/detail/lost_workers.h)
//      gives nothing back, so the others take it back for it: an owner
//      drops the forks the lost worker held (R5 then frees the value), a
//      user drops the forks a lost owner had (their uses fail with
//      kWorkerUnavailable) and counts the forks it handed to the lost
//      worker as accepted (R4 may then delete its own).
//
// Limits: if a message that carries a reference is lost (its call fails
// before delivery), its parent keeps its fork until shutdown: a bounded
// leak, never an early free (G1 before G2). A kFetch naming an RRef that is
// never created leaves an empty pending record until shutdown. Tombstones
// and the ids of dropped records are capped (kMaxTombstones each); the
// oldest go first, so a use that comes later than kMaxTombstones drops (at
// 10 k drops a second, 6.5 s) makes a pending record again. A fork that a lost
// worker handed on shortly before it died is only safe if the receiver's
// kForkNotify reaches the owner before the owner learns of the loss; otherwise
// the owner may free the value first and the receiver's uses of it wait for
// their timeout.

namespace detail {
class RRefHandle;
struct OwnerRecord;
struct UserFork;
} // namespace detail

// Readable by tests and metrics.
struct RRefCounters {
  // RRefs this worker owns that forks still refer to (or that are pending).
  size_t ownerRRefs = 0;
  // Forks this worker holds, until their deletion was acknowledged.
  size_t userRRefs = 0;
  // Forks this worker handed on that the owner has not registered yet.
  size_t pendingForks = 0;
  // Forks this worker holds that the owner has not confirmed yet.
  size_t pendingConfirmations = 0;
  // Deletions that came before their RRef existed (R6).
  size_t tombstones = 0;
  // Uses (kFetch, kCallOn) refused since start because they came after
  // their RRef's record was dropped here (R6); a count, not a table.
  size_t lateUses = 0;
};

// The RRef layer of one worker: its owner and user tables, its message
// handlers and the "rref" value extension. Owned by the Runtime (a
// RuntimeLayer); RRef handles refer to it weakly.
//
// Thread-safe. No lock is held while a message is sent, a future completes
// or a value is destroyed (a value may itself hold RRefs).
class RRefContext : public rpc::RuntimeLayer,
                    public std::enable_shared_from_this<RRefContext> {
 public:
  static constexpr size_t kMaxTombstones = 1 << 16;
  static constexpr size_t kMaxForksPerDeletion = 4096;

  // Adds the layer to `runtime` (before start()) and returns it.
  static std::shared_ptr<RRefContext> install(rpc::Runtime& runtime);
  // The layer of `runtime`; throws c10::Error if it was not installed.
  static std::shared_ptr<RRefContext> of(rpc::Runtime& runtime);

  ~RRefContext() override;

  RRefCounters counters() const;
  // What the tables held when closed() ran: all zero after a graceful
  // shutdown that gave everything back (G5).
  RRefCounters leftAtClose() const;

  // ---- used by RRef<T> (rref/rref.h) ----------------------------------

  // remote(): an RRef owned by `to` whose value is function(args...), or
  // function(receiver's value, args...). Returns at once. Never throws: a
  // failure is the RRef's creation error (G4).
  c10::intrusive_ptr<detail::RRefHandle> remote(
      const rpc::WorkerRef& to,
      const std::string& function,
      std::vector<c10::IValue> args,
      c10::TypePtr type,
      std::chrono::milliseconds timeout,
      const detail::RRefHandle* receiver = nullptr);

  // An owner RRef of a value of this worker.
  c10::intrusive_ptr<detail::RRefHandle> makeOwned(
      c10::IValue value,
      c10::TypePtr type);

  // A copy of the value; on the owner too. Never throws.
  c10::intrusive_ptr<c10::ivalue::Future> toHere(
      const detail::RRefHandle& handle,
      std::chrono::milliseconds timeout);

  // function(value, args...) on the owner, which passes the value itself.
  // Never throws.
  c10::intrusive_ptr<c10::ivalue::Future> callOn(
      const detail::RRefHandle& handle,
      const std::string& function,
      std::vector<c10::IValue> args,
      std::chrono::milliseconds timeout);

  // Completes when the owner has confirmed the reference: on the creator,
  // once the value exists (with the creation error if it failed); on the
  // owner, once the value is set. Never throws.
  c10::intrusive_ptr<c10::ivalue::Future> confirmation(
      const detail::RRefHandle& handle);

  // The value itself, on the owner (waits for its creation). Throws
  // c10::Error on a user, the creation error if it failed.
  c10::IValue localValue(const detail::RRefHandle& handle);

  // Replaces the value, on the owner, once it was created: later uses read
  // `value`, uses already running keep the value they read. Throws c10::Error
  // on a user, before the value exists, or if creating it failed.
  void setLocalValue(const detail::RRefHandle& handle, c10::IValue value);

  std::chrono::milliseconds defaultTimeout() const;
  const rpc::WorkerInfo& self() const;

  // ---- RuntimeLayer ---------------------------------------------------
  std::string name() const override;
  bool release(std::chrono::steady_clock::time_point deadline) override;
  void workerLost(const rpc::WorkerInfo& worker, const std::string& cause)
      override;
  void closed() override;
  // The tables' sizes (RRefCounters) and the messages in flight.
  void reportMetrics(rpc::LayerMetrics& out) const override;
  // Forks and confirmations this worker waits for, and from whom.
  void describeWaits(std::vector<std::string>& out) const override;

  // Called by a user handle's destructor.
  void userHandleGone(const std::shared_ptr<detail::UserFork>& fork);

 private:
  struct Token {};

 public:
  RRefContext(Token, rpc::Runtime& runtime);

 private:
  class WireReader;
  class RuntimeUse;

  void registerWithAgent();
  GlobalId mintId();
  RRefCounters countersLocked() const;

  // Sends through the agent unless closed() has begun (see RuntimeUse).
  // Never throws.
  c10::intrusive_ptr<c10::ivalue::Future> send(
      int64_t to,
      uint32_t kind,
      std::string body,
      std::vector<c10::IValue> values,
      std::string what,
      std::chrono::milliseconds timeout);

  // The value extension.
  void encodeRRef(
      const c10::IValue& value,
      int64_t toWorker,
      std::string* payload,
      std::vector<c10::IValue>* nested);
  c10::IValue decodeRRef(
      int64_t fromWorker,
      const std::string& payload,
      std::vector<c10::IValue>&& nested);

  // Handlers, one per message kind.
  c10::intrusive_ptr<c10::ivalue::Future> onRemote(rpc::Request&& request);
  c10::intrusive_ptr<c10::ivalue::Future> onCallOn(rpc::Request&& request);
  c10::intrusive_ptr<c10::ivalue::Future> onFetch(rpc::Request&& request);
  c10::intrusive_ptr<c10::ivalue::Future> onForkNotify(rpc::Request&& request);
  c10::intrusive_ptr<c10::ivalue::Future> onChildAccepted(
      rpc::Request&& request);
  c10::intrusive_ptr<c10::ivalue::Future> onDeleteFork(rpc::Request&& request);

  // Owner side. The record of `id`, created pending if unknown (R6).
  std::shared_ptr<detail::OwnerRecord> recordLocked(const RRefId& id);
  // R6: whether a use of `id` comes after its record was dropped here (and
  // not put back since); counts it.
  bool lateUseLocked(const RRefId& id);
  std::exception_ptr lateUseError(
      const RRefId& id,
      const rpc::Request& request,
      const std::string& what) const;
  // The record a use (kFetch, kCallOn) names, as recordLocked(); throws
  // kBadArguments if the use is late.
  std::shared_ptr<detail::OwnerRecord> recordForUseLocked(
      const RRefId& id,
      const rpc::Request& request,
      const char* what);
  // R5; what it drops goes into *dropped, to be freed outside the lock.
  void maybeDropRecordLocked(
      const std::shared_ptr<detail::OwnerRecord>& record,
      std::vector<std::shared_ptr<detail::OwnerRecord>>* dropped);
  void settleRecord(
      const std::shared_ptr<detail::OwnerRecord>& record,
      c10::ivalue::Future& result);
  void addTombstoneLocked(const RRefId& rref, const ForkId& fork);
  bool takeTombstoneLocked(const RRefId& rref, const ForkId& fork);

  // User side.
  std::shared_ptr<detail::UserFork> addUserForkLocked(
      const RRefId& rref,
      const ForkId& fork,
      int64_t owner,
      bool confirmed);
  void forkConfirmed(
      const std::shared_ptr<detail::UserFork>& fork,
      std::exception_ptr error,
      bool neverSent);
  void childAccepted(const ForkId& child);
  // Sends kDeleteFork if R4 allows it now. Without the lock.
  void maybeDeleteFork(const std::shared_ptr<detail::UserFork>& fork);
  // One kDeleteFork in flight per owner; deletions that come meanwhile wait
  // and go together when it is answered (R7 holds: the one in flight covers
  // them).
  void sendDelete(const std::shared_ptr<detail::UserFork>& fork);
  void sendDeleteBatch(
      int64_t owner,
      std::vector<std::shared_ptr<detail::UserFork>> batch);
  void eraseUserFork(const ForkId& fork);

  // Runs function(value, args...) once `value` (a record's future) is set.
  c10::intrusive_ptr<c10::ivalue::Future> invokeOnValue(
      const c10::intrusive_ptr<c10::ivalue::Future>& value,
      const std::string& function,
      std::vector<c10::IValue> args);

  rpc::Runtime& runtime_;
  rpc::Agent& agent_;
  const rpc::WorkerInfo self_;
  std::atomic<uint64_t> nextLocalId_{1};

  mutable std::mutex mutex_;
  // closed() waits until no RuntimeUse is left.
  std::condition_variable runtimeUsesDone_;
  size_t runtimeUses_ = 0;
  bool closed_ = false;
  RRefCounters leftAtClose_;
  // Notified when the user table becomes empty (release() waits on it).
  std::condition_variable forksGone_;

  // Owner table: RRefs this worker owns that forks refer to (R5).
  std::unordered_map<RRefId, std::shared_ptr<detail::OwnerRecord>, GlobalIdHash>
      owned_;
  // User table: forks held here, until their deletion is acknowledged.
  std::unordered_map<ForkId, std::shared_ptr<detail::UserFork>, GlobalIdHash>
      userForks_;
  // Pending children: fork handed on -> the fork held here it came from,
  // and the worker it went to.
  struct PendingChild {
    std::shared_ptr<detail::UserFork> parent;
    int64_t to = -1;
  };
  std::unordered_map<ForkId, PendingChild, GlobalIdHash> pendingChildren_;
  size_t pendingConfirmations_ = 0;
  // Deletions per owner (see sendDelete).
  struct DeletionQueue {
    bool inFlight = false;
    std::vector<std::shared_ptr<detail::UserFork>> queued;
  };
  std::unordered_map<int64_t, DeletionQueue> deletions_;
  // R6: deletions that came before their RRef, oldest first.
  std::deque<std::pair<RRefId, ForkId>> tombstones_;
  // R6: the RRefs whose records were dropped here, oldest first (capped).
  std::unordered_set<RRefId, GlobalIdHash> droppedIds_;
  std::deque<RRefId> droppedOrder_;
  size_t lateUses_ = 0;
};

} // namespace rref
} // namespace torchrpc
