#include "torchrpc/rref/rref_context.h"

// RRefContext: set-up, sending, counters and shutdown. The protocol itself
// is split by side: rref_user_side.cpp, rref_owner_side.cpp and
// rref_value_extension.cpp (see Note [RRef fork protocol]).

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include "proto/rref/rref.pb.h"
#include "torchrpc/rpc/log_level.h"
#include "torchrpc/rref/detail/context_internals.h"
#include "torchrpc/rref/detail/records.h"
#include "torchrpc/rref/rref_handle.h"

namespace torchrpc {
namespace rref {

// ---- set-up ---------------------------------------------------------------

std::shared_ptr<RRefContext> RRefContext::install(rpc::Runtime& runtime) {
  auto context = std::make_shared<RRefContext>(Token{}, runtime);
  context->registerWithAgent();
  runtime.addLayer(context);
  return context;
}

std::shared_ptr<RRefContext> RRefContext::of(rpc::Runtime& runtime) {
  auto context = runtime.findLayer<RRefContext>();
  TORCH_CHECK(
      context,
      "runtime '",
      runtime.self().name,
      "' has no RRef layer: use torchrpc::Runtime, or call "
      "torchrpc::rref::RRefContext::install(runtime) before start()");
  return context;
}

RRefContext::RRefContext(Token, rpc::Runtime& runtime)
    : runtime_(runtime),
      agent_(runtime.agent()),
      self_(runtime.self()) {}

RRefContext::~RRefContext() = default;

std::string RRefContext::name() const {
  return "rref";
}

const rpc::WorkerInfo& RRefContext::self() const {
  return self_;
}

std::chrono::milliseconds RRefContext::defaultTimeout() const {
  return runtime_.options().defaultTimeout;
}

void RRefContext::registerWithAgent() {
  std::weak_ptr<RRefContext> weak = weak_from_this();
  using Handler = FuturePtr (RRefContext::*)(rpc::Request &&);
  auto add = [&](uint32_t kind, const char* name, Handler handler) {
    agent_.registerHandler(
        kind,
        name,
        [weak, handler, name](rpc::Request&& request) -> FuturePtr {
          auto self = weak.lock();
          if (!self) {
            throw RpcError(
                ErrorCode::kShuttingDown,
                "",
                name,
                request.id,
                "the RRef layer is gone");
          }
          return ((*self).*handler)(std::move(request));
        });
  };
  add(kRemoteKind, "rref.remote", &RRefContext::onRemote);
  add(kCallOnKind, "rref.callOn", &RRefContext::onCallOn);
  add(kFetchKind, "rref.fetch", &RRefContext::onFetch);
  add(kForkNotifyKind, "rref.forkNotify", &RRefContext::onForkNotify);
  add(kChildAcceptedKind, "rref.childAccepted", &RRefContext::onChildAccepted);
  add(kDeleteForkKind, "rref.deleteFork", &RRefContext::onDeleteFork);

  rpc::ValueExtension extension;
  extension.kind = "rref";
  extension.matches = [](const c10::IValue& value) { return value.isRRef(); };
  extension.encode = [weak](
                         const c10::IValue& value,
                         int64_t toWorker,
                         std::string* payload,
                         std::vector<c10::IValue>* nested) {
    auto self = weak.lock();
    TORCH_CHECK(self, "the RRef layer is gone");
    self->encodeRRef(value, toWorker, payload, nested);
  };
  extension.decode = [weak](
                         int64_t fromWorker,
                         const std::string& payload,
                         std::vector<c10::IValue>&& nested) {
    auto self = weak.lock();
    TORCH_CHECK(self, "the RRef layer is gone");
    return self->decodeRRef(fromWorker, payload, std::move(nested));
  };
  agent_.addValueExtension(std::move(extension));
}

GlobalId RRefContext::mintId() {
  return GlobalId{self_.id, nextLocalId_.fetch_add(1)};
}

FuturePtr RRefContext::send(
    int64_t to,
    uint32_t kind,
    std::string body,
    std::vector<c10::IValue> values,
    std::string what,
    std::chrono::milliseconds timeout) {
  RuntimeUse use(*this);
  if (!use) {
    const auto& workers = agent_.workers();
    return failedFuture(rpc::makeRpcError(
        ErrorCode::kShuttingDown,
        to >= 0 && to < static_cast<int64_t>(workers.size())
            ? workers[to].name
            : std::to_string(to),
        what,
        0,
        "the runtime of '" + self_.name + "' has shut down"));
  }
  rpc::OutgoingRequest request;
  request.kind = kind;
  request.body = std::move(body);
  request.values = std::move(values);
  request.what = std::move(what);
  request.timeout = timeout;
  return agent_.send(rpc::WorkerRef(to), std::move(request));
}

RRefCounters RRefContext::countersLocked() const {
  RRefCounters counters;
  counters.ownerRRefs = owned_.size();
  counters.userRRefs = userForks_.size();
  counters.pendingForks = pendingChildren_.size();
  counters.pendingConfirmations = pendingConfirmations_;
  counters.tombstones = tombstones_.size();
  counters.lateUses = lateUses_;
  return counters;
}

RRefCounters RRefContext::counters() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return countersLocked();
}

void RRefContext::reportMetrics(rpc::LayerMetrics& out) const {
  RRefCounters c = counters();
  using Kind = rpc::LayerValue::Kind;
  out.values = {
      {"owned",
       "RRefs owned here that forks refer to.",
       Kind::kGauge,
       static_cast<double>(c.ownerRRefs)},
      {"user_forks",
       "Forks held here until their deletion is acknowledged.",
       Kind::kGauge,
       static_cast<double>(c.userRRefs)},
      {"pending_forks",
       "Forks handed on here that the owner has not registered yet.",
       Kind::kGauge,
       static_cast<double>(c.pendingForks)},
      {"pending_confirmations",
       "Forks held here that the owner has not confirmed yet.",
       Kind::kGauge,
       static_cast<double>(c.pendingConfirmations)},
      {"tombstones",
       "Deletions that came before their RRef existed.",
       Kind::kGauge,
       static_cast<double>(c.tombstones)},
      {"late_uses_refused",
       "Uses refused because they came after their RRef was deleted here.",
       Kind::kCounter,
       static_cast<double>(c.lateUses)},
  };
}

void RRefContext::describeWaits(std::vector<std::string>& out) const {
  // Enough to see what is stuck; the counts say how much more there is.
  constexpr size_t kMaxLines = 32;
  const auto& workers = agent_.workers();
  auto nameOf = [&](int64_t id) {
    return id >= 0 && id < static_cast<int64_t>(workers.size())
        ? "'" + workers[id].name + "'"
        : "worker " + std::to_string(id);
  };
  std::vector<std::string> lines;
  size_t more = 0;
  auto add = [&](std::string line) {
    if (lines.size() < kMaxLines) {
      lines.push_back(std::move(line));
    } else {
      ++more;
    }
  };
  std::lock_guard<std::mutex> guard(mutex_);
  for (const auto& entry : userForks_) {
    const auto& fork = entry.second;
    if (!fork->confirmed.load() && fork->owner >= 0) {
      add("fork " + fork->fork.toString() + " of RRef " +
          fork->rref.toString() + " awaits its confirmation by the owner " +
          nameOf(fork->owner));
    }
  }
  for (const auto& entry : pendingChildren_) {
    const auto& parent = entry.second.parent;
    add("fork " + entry.first.toString() + " of RRef " +
        (parent ? parent->rref.toString() : std::string("?")) + ", handed to " +
        nameOf(entry.second.to) + ", awaits its registration by the owner " +
        (parent ? nameOf(parent->owner) : std::string("?")));
  }
  for (const auto& entry : deletions_) {
    if (entry.second.inFlight) {
      add("a deletion of forks awaits its answer from the owner " +
          nameOf(entry.first) + " (" +
          std::to_string(entry.second.queued.size()) + " more queued)");
    }
  }
  for (auto& line : lines) {
    out.push_back(std::move(line));
  }
  if (more > 0) {
    out.push_back("... and " + std::to_string(more) + " more");
  }
}

RRefCounters RRefContext::leftAtClose() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return leftAtClose_;
}

// ---- shutdown
// -------------------------------------------------------------------

bool RRefContext::release(std::chrono::steady_clock::time_point deadline) {
  // Protocol messages still travelling settle first (R7).
  agent_.waitForNoPendingCalls(deadline);
  std::vector<std::shared_ptr<UserFork>> toDelete;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    for (auto& entry : userForks_) {
      auto& fork = entry.second;
      if (fork->deleting) {
        continue;
      }
      // G5: every fork goes, whether or not a handle still refers to it.
      fork->deleting = true;
      if (fork->unknownToOwner) {
        continue;
      }
      toDelete.push_back(fork);
    }
    for (auto it = userForks_.begin(); it != userForks_.end();) {
      if (it->second->unknownToOwner && it->second->deleting) {
        it = userForks_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (const auto& fork : toDelete) {
    sendDelete(fork);
  }
  // Each fork leaves the table when the owner has answered its deletion
  // (or the deletion failed).
  std::unique_lock<std::mutex> lock(mutex_);
  bool done = forksGone_.wait_until(lock, deadline, [this]() {
    return userForks_.empty();
  });
  if (!done) {
    TORCHRPC_LOG(kWarning)
        << self_.name << ": " << userForks_.size()
        << " RRef forks were not released before the deadline";
  }
  return done;
}

void RRefContext::workerLost(
    const rpc::WorkerInfo& worker,
    const std::string& /*cause*/) {
  // G6.
  std::vector<std::shared_ptr<OwnerRecord>> dropped;
  std::vector<ForkId> childrenGone;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    if (closed_) {
      return;
    }
    // Owner side: the forks it held.
    std::vector<std::shared_ptr<OwnerRecord>> records;
    for (const auto& entry : owned_) {
      records.push_back(entry.second);
    }
    for (const auto& record : records) {
      size_t before = record->forks.size();
      for (auto it = record->forks.begin(); it != record->forks.end();) {
        it = it->second == worker.id ? record->forks.erase(it) : std::next(it);
      }
      if (record->forks.size() != before) {
        maybeDropRecordLocked(record, &dropped);
      }
    }
    // User side: forks of RRefs it owned cannot be given back.
    for (auto it = userForks_.begin(); it != userForks_.end();) {
      const auto& fork = it->second;
      if (fork->owner != worker.id) {
        ++it;
        continue;
      }
      fork->deleting = true;
      if (!fork->confirmed) {
        --pendingConfirmations_;
      }
      it = userForks_.erase(it);
    }
    deletions_.erase(worker.id);
    if (userForks_.empty()) {
      forksGone_.notify_all();
    }
    // Forks handed to it: it will never announce them.
    for (const auto& entry : pendingChildren_) {
      if (entry.second.to == worker.id) {
        childrenGone.push_back(entry.first);
      }
    }
  }
  for (const auto& child : childrenGone) {
    childAccepted(child);
  }
  // `dropped` (and maybe values) are freed here, outside the lock.
}

void RRefContext::closed() {
  decltype(owned_) owned;
  decltype(userForks_) userForks;
  decltype(pendingChildren_) pendingChildren;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    closed_ = true;
    runtimeUsesDone_.wait(lock, [this]() { return runtimeUses_ == 0; });
    leftAtClose_ = countersLocked();
    owned.swap(owned_);
    userForks.swap(userForks_);
    pendingChildren.swap(pendingChildren_);
    deletions_.clear();
    tombstones_.clear();
    droppedIds_.clear();
    droppedOrder_.clear();
    pendingConfirmations_ = 0;
  }
  // Values still being created or waited for fail now.
  for (auto& entry : owned) {
    if (!entry.second->value->completed()) {
      entry.second->value->setError(rpc::makeRpcError(
          ErrorCode::kShuttingDown,
          self_.name,
          "",
          0,
          describe(entry.first) + " was never created before shutdown"));
    }
  }
  // The tables (and maybe values holding RRefs) are freed outside the lock.
}

} // namespace rref
} // namespace torchrpc
