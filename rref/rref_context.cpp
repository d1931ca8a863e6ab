#include "rref/rref_context.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include "proto/rref/rref.pb.h"
#include "rref/detail/records.h"
#include "rref/rref_handle.h"

namespace torchrpc {
namespace rref {

using detail::OwnerRecord;
using detail::RRefHandle;
using detail::UserFork;
using rpc::ErrorCode;
using rpc::RpcError;
using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

namespace {

void toWire(const GlobalId& id, wire::Id* out) {
  out->set_worker(id.worker);
  out->set_local(id.local);
}

template <typename M>
std::string serialize(const M& message) {
  std::string bytes;
  message.SerializeToString(&bytes);
  return bytes;
}

FuturePtr newFuture() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
}

FuturePtr readyFuture(c10::IValue value = c10::IValue()) {
  auto future = newFuture();
  future->markCompleted(std::move(value));
  return future;
}

FuturePtr failedFuture(std::exception_ptr error) {
  auto future = newFuture();
  future->setError(std::move(error));
  return future;
}

void forward(c10::ivalue::Future& from, c10::ivalue::Future& to) {
  if (from.hasError()) {
    to.setError(from.exception_ptr());
  } else {
    to.markCompleted(from.value());
  }
}

std::string describe(const GlobalId& id) {
  return "RRef " + id.toString();
}

} // namespace

// Reads ids a peer sent: each must name a worker of the job.
class RRefContext::WireReader {
 public:
  WireReader(const rpc::Request& request, int64_t worldSize)
      : request_(request),
        worldSize_(worldSize) {}

  template <typename M>
  M parse() const {
    M message;
    if (!message.ParseFromString(request_.body)) {
      fail("its body does not parse");
    }
    return message;
  }

  GlobalId id(const wire::Id& id) const {
    workerId(id.worker());
    return GlobalId{id.worker(), id.local()};
  }

  int64_t workerId(int64_t worker) const {
    if (worker < 0 || worker >= worldSize_) {
      fail("it names worker " + std::to_string(worker));
    }
    return worker;
  }

  [[noreturn]] void fail(const std::string& why) const {
    throw RpcError(
        ErrorCode::kMalformedMessage,
        request_.from.name,
        "rref message kind " + std::to_string(request_.kind),
        request_.id,
        "malformed RRef message: " + why);
  }

 private:
  const rpc::Request& request_;
  int64_t worldSize_;
};

// Marks a use of the runtime: closed() waits until every use has ended, so
// nothing touches the agent or the registry once they are being torn down.
class RRefContext::RuntimeUse {
 public:
  explicit RuntimeUse(RRefContext& context) : context_(context) {
    std::lock_guard<std::mutex> guard(context_.mutex_);
    entered_ = !context_.closed_;
    if (entered_) {
      ++context_.runtimeUses_;
    }
  }
  ~RuntimeUse() {
    if (!entered_) {
      return;
    }
    std::lock_guard<std::mutex> guard(context_.mutex_);
    if (--context_.runtimeUses_ == 0) {
      context_.runtimeUsesDone_.notify_all();
    }
  }
  RuntimeUse(const RuntimeUse&) = delete;
  RuntimeUse& operator=(const RuntimeUse&) = delete;

  explicit operator bool() const {
    return entered_;
  }

 private:
  RRefContext& context_;
  bool entered_ = false;
};

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
  return counters;
}

RRefCounters RRefContext::counters() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return countersLocked();
}

RRefCounters RRefContext::leftAtClose() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return leftAtClose_;
}

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
      result = invokeOnValue(receiver->record()->value, function, args);
    } else {
      result = runtime_.invokeLocal(function, std::move(args));
    }
    std::weak_ptr<RRefContext> weak = weak_from_this();
    result->addCallback([weak, record](c10::ivalue::Future& done) {
      if (auto self = weak.lock()) {
        self->settleRecord(record, done);
      } else if (!record->value->completed()) {
        forward(done, *record->value);
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

// The creation error of a user's fork, if creation failed (G4).
std::exception_ptr creationError(const UserFork& fork) {
  if (fork.creation && fork.creation->completed() &&
      fork.creation->hasError()) {
    return fork.creation->exception_ptr();
  }
  return nullptr;
}

// Keeps `handle` (and so its fork) alive until `future` completes: a
// deletion must not overtake a message that names the fork.
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
// the creation error too (G4), even if the owner produced the value late.
FuturePtr preferCreationError(
    const std::shared_ptr<UserFork>& fork,
    FuturePtr reply) {
  if (!fork->creation || fork->creation->completed()) {
    return reply;
  }
  // Whichever settles first: the creation failing, or the reply.
  auto out = newFuture();
  auto settled = std::make_shared<std::atomic<bool>>(false);
  fork->creation->addCallback([out, settled](c10::ivalue::Future& creation) {
    if (creation.hasError() && !settled->exchange(true)) {
      out->setError(creation.exception_ptr());
    }
  });
  reply->addCallback([fork, out, settled](c10::ivalue::Future& done) {
    if (settled->exchange(true)) {
      return;
    }
    if (auto error = creationError(*fork)) {
      out->setError(error);
    } else {
      forward(done, *out);
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
    handle.record()->value->addCallback(
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
  return keepAliveUntilDone(
      preferCreationError(
          fork,
          send(
              fork->owner,
              kFetchKind,
              serialize(message),
              {},
              "RRef.toHere",
              timeout)),
      retain(handle));
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
    return invokeOnValue(handle.record()->value, function, std::move(args));
  }
  const auto& fork = handle.fork();
  if (auto error = creationError(*fork)) {
    return failedFuture(error);
  }
  wire::CallOnRequest message;
  toWire(fork->rref, message.mutable_rref());
  message.set_function(function);
  return keepAliveUntilDone(
      preferCreationError(
          fork,
          send(
              fork->owner,
              kCallOnKind,
              serialize(message),
              std::move(args),
              function,
              timeout)),
      retain(handle));
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
  const auto& value = handle.record()->value;
  value->wait();
  if (value->hasError()) {
    std::rethrow_exception(value->exception_ptr());
  }
  return value->value();
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
        [out](c10::ivalue::Future& done) { forward(done, *out); });
  });
  return out;
}

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
    record->forks.insert(fork);
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
    pendingChildren_.emplace(fork, parent);
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

// ---- handlers (owner side, but kChildAccepted) ------------------------------

FuturePtr RRefContext::onRemote(rpc::Request&& request) {
  WireReader reader(request, static_cast<int64_t>(agent_.workers().size()));
  auto message = reader.parse<wire::RemoteRequest>();
  RRefId rref = reader.id(message.rref());
  ForkId fork = reader.id(message.fork());
  if (rref.worker != request.from.id || fork.worker != request.from.id) {
    reader.fail("the creator did not mint its ids");
  }
  std::shared_ptr<OwnerRecord> record;
  std::shared_ptr<OwnerRecord> receiver;
  bool gaveUp = false;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    record = recordLocked(rref);
    if (record->creating) {
      reader.fail(describe(rref) + " is being created already");
    }
    record->creating = true;
    gaveUp = takeTombstoneLocked(rref, fork);
    if (!gaveUp) {
      record->forks.insert(fork);
      if (message.has_receiver()) {
        receiver = recordLocked(reader.id(message.receiver()));
      }
    }
  }
  FuturePtr result;
  if (gaveUp) {
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
        receiver->value,
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
    record = recordLocked(rref); // R6: may wait for the value
  }
  return invokeOnValue(
      record->value,
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
    record = recordLocked(rref); // R6: may wait for the value
  }
  // The response is the copy: the codec writes the value's bytes.
  return record->value;
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
      recordLocked(rref)->forks.insert(fork);
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

void RRefContext::maybeDropRecordLocked(
    const std::shared_ptr<OwnerRecord>& record,
    std::vector<std::shared_ptr<OwnerRecord>>* dropped) {
  if (record->inTable && record->forks.empty() && record->value->completed()) {
    record->inTable = false;
    auto it = owned_.find(record->id);
    dropped->push_back(std::move(it->second));
    owned_.erase(it);
  }
}

void RRefContext::settleRecord(
    const std::shared_ptr<OwnerRecord>& record,
    c10::ivalue::Future& result) {
  if (!record->value->completed()) {
    forward(result, *record->value);
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
    LOG(WARNING) << self_.name << ": the owner did not register fork "
                 << fork->fork.toString() << " of " << describe(fork->rref)
                 << ": " << rpc::describeException(error);
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
    parent = std::move(it->second);
    pendingChildren_.erase(it);
    --parent->pendingChildren;
  }
  maybeDeleteFork(parent); // R7: before the acceptance is answered
}

void RRefContext::eraseUserFork(const ForkId& fork) {
  std::lock_guard<std::mutex> guard(mutex_);
  userForks_.erase(fork);
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
      VLOG(1) << self->self_.name << ": deleting " << batch.size()
              << " forks on worker " << owner
              << " failed: " << rpc::describeException(done.exception_ptr());
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
    LOG(WARNING) << self_.name << ": " << userForks_.size()
                 << " RRef forks were not released before the deadline";
  }
  return done;
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
