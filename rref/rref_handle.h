#pragma once

#include <ATen/core/ivalue.h>
#include <ATen/core/rref_interface.h>

#include <memory>
#include <string>

#include "torchrpc/rpc/worker_info.h"
#include "torchrpc/rref/rref_id.h"

namespace torchrpc {
namespace rref {

class RRefContext;

namespace detail {

struct OwnerRecord;
struct UserFork;

// The object behind every RRef<T>: one per fork a user holds, or one per
// owner-side reference. It is a c10::RRefInterface, so an RRef travels
// inside any IValue (lists, tuples, dicts) like libtorch's own. Copies of an
// RRef<T> share it; when the last one goes, a user gives its fork up (see
// Note [RRef fork protocol] in rref/rref_context.h).
class RRefHandle : public c10::RRefInterface {
 public:
  // A user's handle of `fork`.
  RRefHandle(
      std::weak_ptr<RRefContext> context,
      rpc::WorkerInfo owner,
      c10::TypePtr type,
      std::shared_ptr<UserFork> fork);
  // An owner's handle of `record`.
  RRefHandle(
      std::weak_ptr<RRefContext> context,
      rpc::WorkerInfo owner,
      c10::TypePtr type,
      std::shared_ptr<OwnerRecord> record);
  ~RRefHandle() override;

  c10::worker_id_t owner() const override;
  std::string ownerName() const override;
  bool isOwner() const override;
  bool confirmedByOwner() const override;
  const c10::TypePtr type() const override;

  const RRefId& id() const;
  const rpc::WorkerInfo& ownerInfo() const {
    return owner_;
  }
  // nullptr once the runtime is gone.
  std::shared_ptr<RRefContext> context() const {
    return context_.lock();
  }
  bool belongsTo(const RRefContext* context) const;
  // Exactly one of the two is set.
  const std::shared_ptr<UserFork>& fork() const {
    return fork_;
  }
  const std::shared_ptr<OwnerRecord>& record() const {
    return record_;
  }

 private:
  std::weak_ptr<RRefContext> context_;
  const RRefContext* contextIdentity_;
  rpc::WorkerInfo owner_;
  c10::TypePtr type_;
  std::shared_ptr<UserFork> fork_;
  std::shared_ptr<OwnerRecord> record_;
};

// The RRefHandle inside `value`, or nullptr if it holds none of ours.
c10::intrusive_ptr<RRefHandle> handleOf(const c10::IValue& value);

// The handle's context, or nullptr once its runtime is gone.
std::shared_ptr<RRefContext> contextOf(const RRefHandle& handle);

// A future failed with kShuttingDown: the handle's runtime is gone.
c10::intrusive_ptr<c10::ivalue::Future> runtimeGoneFuture(
    const RRefHandle& handle,
    const std::string& what);

} // namespace detail
} // namespace rref
} // namespace torchrpc
