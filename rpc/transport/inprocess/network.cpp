#include "torchrpc/rpc/transport/inprocess/network.h"

#include <utility>

namespace torchrpc {
namespace rpc {

void InProcessNetwork::setFaultInjector(FaultInjector injector) {
  std::shared_ptr<const FaultInjector> shared;
  if (injector) {
    shared = std::make_shared<const FaultInjector>(std::move(injector));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  faultInjector_ = std::move(shared);
}

std::string InProcessNetwork::allocateAddress() {
  std::lock_guard<std::mutex> lock(mutex_);
  return "inproc://" + std::to_string(nextAddressId_++);
}

void InProcessNetwork::bind(
    const std::string& address,
    std::weak_ptr<detail::InProcessTransportImpl> transport) {
  std::lock_guard<std::mutex> lock(mutex_);
  listeners_[address] = std::move(transport);
}

void InProcessNetwork::unbind(const std::string& address) {
  std::lock_guard<std::mutex> lock(mutex_);
  listeners_.erase(address);
}

std::shared_ptr<detail::InProcessTransportImpl> InProcessNetwork::lookup(
    const std::string& address) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = listeners_.find(address);
  return it == listeners_.end() ? nullptr : it->second.lock();
}

FaultAction InProcessNetwork::decide(
    const std::string& fromAddress,
    const std::string& toAddress,
    const Message& message) {
  std::shared_ptr<const FaultInjector> injector;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    injector = faultInjector_;
  }
  // Called outside the lock so that an injector may take its own locks.
  return injector ? (*injector)(fromAddress, toAddress, message)
                  : FaultAction::deliver();
}

} // namespace rpc
} // namespace torchrpc
