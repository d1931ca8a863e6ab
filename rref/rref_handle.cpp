#include "torchrpc/rref/rref_handle.h"

#include "torchrpc/rpc/errors.h"

#include <c10/util/Exception.h>

#include "torchrpc/rref/detail/records.h"
#include "torchrpc/rref/rref_context.h"

namespace torchrpc {
namespace rref {
namespace detail {

RRefHandle::RRefHandle(
    std::weak_ptr<RRefContext> context,
    rpc::WorkerInfo owner,
    c10::TypePtr type,
    std::shared_ptr<UserFork> fork)
    : context_(std::move(context)),
      contextIdentity_(context_.lock().get()),
      owner_(std::move(owner)),
      type_(std::move(type)),
      fork_(std::move(fork)) {
  TORCH_INTERNAL_ASSERT(fork_);
}

RRefHandle::RRefHandle(
    std::weak_ptr<RRefContext> context,
    rpc::WorkerInfo owner,
    c10::TypePtr type,
    std::shared_ptr<OwnerRecord> record)
    : context_(std::move(context)),
      contextIdentity_(context_.lock().get()),
      owner_(std::move(owner)),
      type_(std::move(type)),
      record_(std::move(record)) {
  TORCH_INTERNAL_ASSERT(record_);
}

RRefHandle::~RRefHandle() {
  if (fork_) {
    if (auto context = context_.lock()) {
      context->userHandleGone(fork_);
    }
  }
}

c10::worker_id_t RRefHandle::owner() const {
  return static_cast<c10::worker_id_t>(owner_.id);
}

std::string RRefHandle::ownerName() const {
  return owner_.name;
}

bool RRefHandle::isOwner() const {
  return record_ != nullptr;
}

bool RRefHandle::confirmedByOwner() const {
  return record_ != nullptr || (fork_->confirmed && !fork_->failed);
}

const c10::TypePtr RRefHandle::type() const {
  return type_;
}

const RRefId& RRefHandle::id() const {
  return record_ ? record_->id : fork_->rref;
}

bool RRefHandle::belongsTo(const RRefContext* context) const {
  return contextIdentity_ == context;
}

c10::intrusive_ptr<RRefHandle> handleOf(const c10::IValue& value) {
  if (!value.isRRef()) {
    return c10::intrusive_ptr<RRefHandle>();
  }
  auto rref = value.toRRef();
  auto* handle = dynamic_cast<RRefHandle*>(rref.get());
  if (handle == nullptr) {
    return c10::intrusive_ptr<RRefHandle>();
  }
  return c10::intrusive_ptr<RRefHandle>::reclaim_copy(handle);
}

std::shared_ptr<RRefContext> contextOf(const RRefHandle& handle) {
  return handle.context();
}

c10::intrusive_ptr<c10::ivalue::Future> runtimeGoneFuture(
    const RRefHandle& handle,
    const std::string& what) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  future->setError(rpc::makeRpcError(
      rpc::ErrorCode::kShuttingDown,
      handle.ownerName(),
      what,
      0,
      "the runtime this RRef belongs to is gone"));
  return future;
}

} // namespace detail
} // namespace rref
} // namespace torchrpc
