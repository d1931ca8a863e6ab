#include "torchrpc/rpc/detail/store_server.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <charconv>
#include <utility>

#include "torchrpc/rpc/detail/store_session.h"
#include "torchrpc/rpc/log_level.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"

namespace torchrpc {
namespace rpc {
namespace detail {

// ---- StoreState
// --------------------------------------------------------------

std::string StoreState::checkKey(const std::string& key) const {
  if (key.empty() || key.size() > limits_.maxKeyBytes) {
    return "a key must have 1 to " + std::to_string(limits_.maxKeyBytes) +
        " bytes, got " + std::to_string(key.size());
  }
  return "";
}

std::string StoreState::storeLocked(const std::string& key, std::string value) {
  if (value.size() > limits_.maxValueBytes) {
    return "a value may have at most " + std::to_string(limits_.maxValueBytes) +
        " bytes, got " + std::to_string(value.size());
  }
  auto it = values_.find(key);
  size_t before = it == values_.end() ? 0 : key.size() + it->second.size();
  size_t after = storedBytes_ - before + key.size() + value.size();
  if (after > limits_.maxStoredBytes) {
    return "the store is full (" + std::to_string(limits_.maxStoredBytes) +
        " bytes of keys and values)";
  }
  storedBytes_ = after;
  if (it == values_.end()) {
    values_.emplace(key, std::move(value));
  } else {
    it->second = std::move(value);
  }
  return "";
}

std::vector<StoreState::WaitDone> StoreState::readyWaitersLocked() {
  std::vector<WaitDone> ready;
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    bool all = true;
    for (const auto& key : it->second.keys) {
      all = all && values_.count(key) > 0;
    }
    if (all) {
      waitingBytes_ -= it->second.bytes;
      ready.push_back(std::move(it->second.done));
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
  return ready;
}

std::string StoreState::set(const std::string& key, std::string value) {
  std::string error = checkKey(key);
  if (!error.empty()) {
    return error;
  }
  std::vector<WaitDone> ready;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    error = storeLocked(key, std::move(value));
    if (!error.empty()) {
      return error;
    }
    ready = readyWaitersLocked();
  }
  for (auto& done : ready) {
    done();
  }
  return "";
}

std::optional<std::string> StoreState::get(const std::string& key) const {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = values_.find(key);
  if (it == values_.end()) {
    return std::nullopt;
  }
  return it->second;
}

std::string StoreState::add(
    const std::string& key,
    int64_t delta,
    int64_t* result) {
  std::string error = checkKey(key);
  if (!error.empty()) {
    return error;
  }
  std::vector<WaitDone> ready;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    int64_t current = 0;
    auto it = values_.find(key);
    if (it != values_.end()) {
      const std::string& text = it->second;
      auto parsed =
          std::from_chars(text.data(), text.data() + text.size(), current);
      if (parsed.ec != std::errc() || parsed.ptr != text.data() + text.size()) {
        return "add() on a key whose value is not a number";
      }
    }
    // A client's delta may be anything: signed overflow would be undefined
    // (the store fuzzer's UBSan build stops on it).
    int64_t sum = 0;
    if (__builtin_add_overflow(current, delta, &sum)) {
      return "add() of " + std::to_string(delta) + " to " +
          std::to_string(current) + " overflows a 64-bit integer";
    }
    *result = sum;
    error = storeLocked(key, std::to_string(*result));
    if (!error.empty()) {
      return error;
    }
    ready = readyWaitersLocked();
  }
  for (auto& done : ready) {
    done();
  }
  return "";
}

bool StoreState::check(const std::vector<std::string>& keys) const {
  std::lock_guard<std::mutex> guard(mutex_);
  for (const auto& key : keys) {
    if (values_.count(key) == 0) {
      return false;
    }
  }
  return true;
}

std::string StoreState::wait(
    uint64_t waitId,
    std::vector<std::string> keys,
    WaitDone done) {
  if (keys.size() > limits_.maxKeysPerRequest) {
    return "a wait may name at most " +
        std::to_string(limits_.maxKeysPerRequest) + " keys, got " +
        std::to_string(keys.size());
  }
  size_t bytes = 0;
  for (const auto& key : keys) {
    std::string error = checkKey(key);
    if (!error.empty()) {
      return error;
    }
    bytes += key.size();
  }
  {
    std::lock_guard<std::mutex> guard(mutex_);
    bool all = true;
    for (const auto& key : keys) {
      all = all && values_.count(key) > 0;
    }
    if (!all) {
      if (waitingBytes_ + bytes > limits_.maxWaitingBytes) {
        return "too many pending waits (" +
            std::to_string(limits_.maxWaitingBytes) + " bytes of keys)";
      }
      if (waiters_.count(waitId) > 0) {
        return "wait id " + std::to_string(waitId) + " is already pending";
      }
      waitingBytes_ += bytes;
      waiters_.emplace(waitId, Waiter{std::move(keys), bytes, std::move(done)});
      return "";
    }
  }
  done();
  return "";
}

bool StoreState::cancelWait(uint64_t waitId) {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = waiters_.find(waitId);
  if (it == waiters_.end()) {
    return false;
  }
  waitingBytes_ -= it->second.bytes;
  waiters_.erase(it);
  return true;
}

void StoreState::clearWaits() {
  std::map<uint64_t, Waiter> dropped;
  std::lock_guard<std::mutex> guard(mutex_);
  dropped.swap(waiters_);
  waitingBytes_ = 0;
}

size_t StoreState::storedBytes() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return storedBytes_;
}

size_t StoreState::pendingWaits() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return waiters_.size();
}

// ---- StoreServer
// -------------------------------------------------------------

struct StoreServer::Impl : std::enable_shared_from_this<StoreServer::Impl> {
  Impl(StoreServerOptions o, std::shared_ptr<StoreState> s)
      : options(std::move(o)),
        state(std::move(s)) {}

  // Each connection gets a session; a connection that fails takes its
  // session's waits with it. The connection and its callbacks hold each
  // other until it fails, when it drops its callbacks.
  void accept(std::shared_ptr<Connection> connection) {
    auto session =
        std::make_shared<StoreSession>(state, [connection](std::string reply) {
          Message message;
          message.header = std::move(reply);
          connection->send(std::move(message), [](const TransportError*) {});
        });
    std::weak_ptr<Impl> weak = shared_from_this();
    connection->start(
        [weak, session, connection](Message&& message) {
          if (!weak.lock()) {
            return;
          }
          std::string refusal = message.tensors.empty()
              ? session->handle(message.header)
              : "a request that does not parse";
          if (!refusal.empty()) {
            TORCHRPC_LOG(kWarning)
                << "rendezvous store: closing the connection from "
                << connection->describe() << ": " << refusal;
            connection->close();
          }
        },
        [session](const TransportError&) { session->close(); });
  }

  const StoreServerOptions options;
  const std::shared_ptr<StoreState> state;
  std::unique_ptr<TcpTransport> transport;
  std::mutex closeMutex;
  bool closed = false;
};

StoreServer::StoreServer(StoreServerOptions options)
    : state_(std::make_shared<StoreState>(options.limits)) {
  TcpTransportOptions transportOptions;
  transportOptions.listenAddress = options.listenAddress;
  transportOptions.limits.maxHeaderBytes = options.limits.maxRequestBytes();
  transportOptions.limits.maxMessageBytes = options.limits.maxRequestBytes();
  transportOptions.limits.maxTensorsPerMessage = 0;
  transportOptions.name = "rendezvous-store";
  transportOptions.sharedSecret = options.sharedSecret;
  transportOptions.handshakeTimeout = options.handshakeTimeout;
  transportOptions.heartbeatInterval = options.heartbeatInterval;
  transportOptions.peerTimeout = options.peerTimeout;
  transportOptions.sameHostZeroCopy = false;
  // Clients connect to the host and port of the init method, never to an
  // address this transport names.
  transportOptions.localSockets = false;
  impl_ = std::make_shared<Impl>(std::move(options), state_);
  impl_->transport = std::make_unique<TcpTransport>(transportOptions);
  std::weak_ptr<Impl> weak = impl_;
  try {
    impl_->transport->listen([weak](std::shared_ptr<Connection> connection) {
      if (auto self = weak.lock()) {
        self->accept(std::move(connection));
      } else {
        connection->start([](Message&&) {}, [](const TransportError&) {});
        connection->close();
      }
    });
  } catch (const c10::Error& e) {
    impl_->transport->close();
    impl_->transport->join();
    TORCH_CHECK(
        false,
        "the rendezvous store cannot listen on ",
        impl_->options.listenAddress,
        ": ",
        e.what_without_backtrace());
  }
}

StoreServer::~StoreServer() {
  close();
}

std::string StoreServer::address() const {
  return impl_->transport->address();
}

void StoreServer::close() {
  std::lock_guard<std::mutex> guard(impl_->closeMutex);
  if (impl_->closed) {
    return;
  }
  impl_->closed = true;
  impl_->transport->close();
  impl_->transport->join();
  state_->clearWaits();
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
