#pragma once

// The network that in-process transports of one job share, and the fault
// injection it offers tests (rpc/transport/inprocess/inprocess_transport.h
// is the transport itself).

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {

namespace detail {
class InProcessConnection;
class InProcessTransportImpl;
} // namespace detail

// What the fault injector decides for one message.
struct FaultAction {
  enum class Kind {
    // Deliver as usual.
    kDeliver,
    // Lose the message silently; the sender's done callback still reports
    // success (the bytes were "handed to the network").
    kDrop,
    // Deliver after `delay`; later messages on the same connection wait
    // behind it, as on a slow link (order is kept).
    kDelay,
    // Deliver after `delay` without holding back later messages, which may
    // overtake it (as if it had travelled on another connection).
    kDelayOutOfOrder,
    // Do not deliver; fail the connection on both sides with
    // kWorkerUnavailable. The sender's done callback gets that error.
    kFailConnection,
  };

  Kind kind = Kind::kDeliver;
  std::chrono::milliseconds delay{0};

  static FaultAction deliver() {
    return FaultAction{};
  }
  static FaultAction drop() {
    return FaultAction{Kind::kDrop, std::chrono::milliseconds(0)};
  }
  static FaultAction delayBy(std::chrono::milliseconds delay) {
    return FaultAction{Kind::kDelay, delay};
  }
  static FaultAction delayOutOfOrder(std::chrono::milliseconds delay) {
    return FaultAction{Kind::kDelayOutOfOrder, delay};
  }
  static FaultAction failConnection() {
    return FaultAction{Kind::kFailConnection, std::chrono::milliseconds(0)};
  }
};

// The "wire" that InProcessTransports of one job share: it allocates their
// addresses ("inproc://N") and routes connect() to listeners. Create one per
// job with std::make_shared and give it to every worker; nothing is global,
// so several jobs in one process never see each other.
//
// Thread-safe.
class InProcessNetwork {
 public:
  // Decides the fate of each message, on the sending thread, inside send().
  // fromAddress/toAddress are the transports' addresses. Must not block and
  // must not call back into the transports.
  using FaultInjector = std::function<FaultAction(
      const std::string& fromAddress,
      const std::string& toAddress,
      const Message& message)>;

  InProcessNetwork() = default;
  InProcessNetwork(const InProcessNetwork&) = delete;
  InProcessNetwork& operator=(const InProcessNetwork&) = delete;

  // Replaces the injector; an empty function delivers everything.
  void setFaultInjector(FaultInjector injector);

 private:
  friend class detail::InProcessConnection;
  friend class detail::InProcessTransportImpl;

  std::string allocateAddress();
  void bind(
      const std::string& address,
      std::weak_ptr<detail::InProcessTransportImpl> transport);
  void unbind(const std::string& address);
  std::shared_ptr<detail::InProcessTransportImpl> lookup(
      const std::string& address);
  FaultAction decide(
      const std::string& fromAddress,
      const std::string& toAddress,
      const Message& message);

  std::mutex mutex_;
  uint64_t nextAddressId_ = 0;
  std::map<std::string, std::weak_ptr<detail::InProcessTransportImpl>>
      listeners_;
  std::shared_ptr<const FaultInjector> faultInjector_;
};

} // namespace rpc
} // namespace torchrpc
