#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "torchrpc/rpc/detail/rendezvous_store.h"

namespace torchrpc {
namespace rpc {
namespace detail {

struct StoreClientOptions {
  // The server's "tcp://ip:port" (StoreServer::address()).
  std::string address;
  // The server's secret, if it has one.
  std::string sharedSecret;
  // How long an operation may take, reconnecting included: the server may
  // start after its clients (rank 0 comes up last), so a client retries
  // until then.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  std::chrono::milliseconds handshakeTimeout{2000};
  std::chrono::milliseconds heartbeatInterval{1000};
  std::chrono::milliseconds peerTimeout{4000};
};

// A connection to a StoreServer (Note [Rendezvous store]). Thread-safe;
// operations block. Errors (the server unreachable within the timeout, a
// refused request) throw c10::Error naming the store's address.
std::unique_ptr<RendezvousStore> connectToStore(StoreClientOptions options);

} // namespace detail
} // namespace rpc
} // namespace torchrpc
