#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "torchrpc/rpc/detail/store_server.h"

namespace torchrpc {
namespace rpc {
namespace detail {

// One client's conversation with a StoreState (Note [Rendezvous store]):
// parses each request (proto/rpc/store.proto), applies it and replies, and
// keeps the client's pending waits so that the client can cancel them and
// so that they go when the client does. The server holds one per
// connection; the store fuzzer (tests/fuzz/store_request_fuzzer.cpp) drives
// one directly, so that both run the same code. Thread-safe.
class StoreSession : public std::enable_shared_from_this<StoreSession> {
 public:
  // Gets each reply as serialized StoreReply bytes: at once for most
  // requests, later (on the thread whose set() or add() completed it) for a
  // wait. Must not call back into the session.
  using SendReply = std::function<void(std::string reply)>;

  StoreSession(std::shared_ptr<StoreState> state, SendReply sendReply);

  // Handles one request. Returns an empty string, or why the request is not
  // one (does not parse, names no operation): the caller then closes the
  // connection. A request the store refuses (a cap) is answered with an
  // error reply instead.
  std::string handle(const std::string& request);

  // The client went away: its pending waits are dropped and no reply is
  // sent any more. Idempotent.
  void close();

 private:
  // Registers a wait for request `requestId`: an empty string when it is
  // pending (replied to once its keys exist), else why it was refused.
  std::string startWait(uint64_t requestId, std::vector<std::string> keys);
  void cancelWait(uint64_t requestId);

  const std::shared_ptr<StoreState> state_;
  const SendReply sendReply_;
  std::mutex mutex_;
  std::unordered_map<uint64_t, uint64_t> waits_; // request id -> wait id
  bool closed_ = false;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
