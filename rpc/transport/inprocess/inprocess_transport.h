#pragma once

#include <memory>
#include <string>

#include "torchrpc/rpc/transport/inprocess/network.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {

namespace detail {
class InProcessTransportImpl;
} // namespace detail

// A transport between workers of one process, for tests. It behaves like a
// network: tensor bytes are copied on send (the receiver gets 1-D kByte
// tensors that share nothing with the sender), and every callback runs
// asynchronously on this transport's delivery thread, never inline from
// send(), connect() or close().
//
// Per connection: messages arrive in order; a peer's close() fails this side
// with kWorkerUnavailable after the messages it sent before closing;
// connect() to an unknown or closed address fails with kWorkerUnavailable;
// a message over this transport's TransportLimits fails the receiving side
// with kMalformedMessage and closes the connection (the sender then sees
// kWorkerUnavailable).
//
// NB: after join() no thread is left, so on a surviving connection send()
// runs its done callback inline (with kWorkerUnavailable) and start() runs
// onError inline. join() and the destructor must not run on a callback.
class InProcessTransport : public Transport {
 public:
  InProcessTransport(
      std::shared_ptr<InProcessNetwork> network,
      TransportLimits limits = TransportLimits());
  ~InProcessTransport() override;

  std::string name() const override;
  void listen(AcceptCallback onAccept) override;
  std::string address() const override;
  std::shared_ptr<Connection> connect(const std::string& address) override;
  void close() override;
  void join() override;
  TransportStats stats() const override;

 private:
  std::shared_ptr<detail::InProcessTransportImpl> impl_;
};

} // namespace rpc
} // namespace torchrpc
