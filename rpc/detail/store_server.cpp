#include "torchrpc/rpc/detail/store_server.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>

#include <atomic>
#include <charconv>
#include <unordered_map>
#include <utility>

#include "proto/rpc/store.pb.h"
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
    *result = current + delta;
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

namespace {

// One client's connection: its pending waits, by the client's request id.
struct Client {
  std::shared_ptr<Connection> connection;
  std::mutex mutex;
  std::unordered_map<uint64_t, uint64_t> waits; // request id -> wait id
  bool closed = false;
};

void sendReply(Connection& connection, const store::StoreReply& reply) {
  Message message;
  message.header = reply.SerializeAsString();
  connection.send(std::move(message), [](const TransportError*) {});
}

std::vector<std::string> keysOf(
    const google::protobuf::RepeatedPtrField<std::string>& keys) {
  return std::vector<std::string>(keys.begin(), keys.end());
}

} // namespace

struct StoreServer::Impl : std::enable_shared_from_this<StoreServer::Impl> {
  Impl(StoreServerOptions o, std::shared_ptr<StoreState> s)
      : options(std::move(o)),
        state(std::move(s)) {}

  void accept(std::shared_ptr<Connection> connection) {
    auto client = std::make_shared<Client>();
    client->connection = connection;
    std::weak_ptr<Impl> weak = shared_from_this();
    connection->start(
        [weak, client](Message&& message) {
          if (auto self = weak.lock()) {
            self->onRequest(client, std::move(message));
          }
        },
        [weak, client](const TransportError&) {
          if (auto self = weak.lock()) {
            self->forget(*client);
          }
        });
  }

  // A client that went away: its waits are dropped.
  void forget(Client& client) {
    std::unordered_map<uint64_t, uint64_t> waits;
    {
      std::lock_guard<std::mutex> guard(client.mutex);
      client.closed = true;
      waits.swap(client.waits);
    }
    for (const auto& wait : waits) {
      state->cancelWait(wait.second);
    }
  }

  void refuse(Client& client, const std::string& why) {
    LOG(WARNING) << "rendezvous store: closing the connection from "
                 << client.connection->describe() << ": " << why;
    client.connection->close();
  }

  void onRequest(const std::shared_ptr<Client>& client, Message&& message) {
    store::StoreRequest request;
    if (!message.tensors.empty() || !request.ParseFromString(message.header)) {
      refuse(*client, "a request that does not parse");
      return;
    }
    store::StoreReply reply;
    reply.set_id(request.id());
    switch (request.op_case()) {
      case store::StoreRequest::kSet:
        reply.set_error(state->set(
            request.set().key(),
            std::move(*request.mutable_set()->mutable_value())));
        break;
      case store::StoreRequest::kGet: {
        auto value = state->get(request.get().key());
        reply.set_found(value.has_value());
        if (value) {
          reply.set_value(std::move(*value));
        }
        break;
      }
      case store::StoreRequest::kAdd: {
        int64_t result = 0;
        reply.set_error(
            state->add(request.add().key(), request.add().delta(), &result));
        reply.set_number(result);
        break;
      }
      case store::StoreRequest::kCheck:
        if (static_cast<size_t>(request.check().keys_size()) >
            options.limits.maxKeysPerRequest) {
          reply.set_error("too many keys in one check");
        } else {
          reply.set_found(state->check(keysOf(request.check().keys())));
        }
        break;
      case store::StoreRequest::kWait: {
        auto error = startWait(client, request);
        if (!error) {
          return; // replied when the keys exist
        }
        reply.set_error(*error);
        break;
      }
      case store::StoreRequest::kCancelWait: {
        uint64_t waitId = 0;
        {
          std::lock_guard<std::mutex> guard(client->mutex);
          auto it = client->waits.find(request.cancel_wait().wait_id());
          if (it == client->waits.end()) {
            return;
          }
          waitId = it->second;
          client->waits.erase(it);
        }
        state->cancelWait(waitId);
        return; // no reply: the client stopped waiting
      }
      case store::StoreRequest::OP_NOT_SET:
        refuse(*client, "a request without an operation");
        return;
    }
    sendReply(*client->connection, reply);
  }

  // Registers a wait: nullopt when it is pending (the reply comes once its
  // keys exist), else why it was refused.
  std::optional<std::string> startWait(
      const std::shared_ptr<Client>& client,
      const store::StoreRequest& request) {
    uint64_t requestId = request.id();
    uint64_t waitId = nextWaitId.fetch_add(1);
    {
      std::lock_guard<std::mutex> guard(client->mutex);
      if (client->closed || client->waits.count(requestId) > 0) {
        return "wait id " + std::to_string(requestId) +
            " is already pending on this connection";
      }
      client->waits.emplace(requestId, waitId);
    }
    std::weak_ptr<Client> weakClient = client;
    std::string error = state->wait(
        waitId,
        keysOf(request.wait().keys()),
        [weakClient, requestId]() {
          auto client = weakClient.lock();
          if (!client) {
            return;
          }
          {
            std::lock_guard<std::mutex> guard(client->mutex);
            if (client->waits.erase(requestId) == 0) {
              return; // cancelled meanwhile
            }
          }
          store::StoreReply reply;
          reply.set_id(requestId);
          reply.set_found(true);
          sendReply(*client->connection, reply);
        });
    if (error.empty()) {
      return std::nullopt;
    }
    {
      std::lock_guard<std::mutex> guard(client->mutex);
      client->waits.erase(requestId);
    }
    return error;
  }

  const StoreServerOptions options;
  const std::shared_ptr<StoreState> state;
  std::unique_ptr<TcpTransport> transport;
  std::atomic<uint64_t> nextWaitId{1};
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
