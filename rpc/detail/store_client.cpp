#include "torchrpc/rpc/detail/store_client.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "proto/rpc/store.pb.h"
#include "torchrpc/rpc/detail/store_server.h"
#include "torchrpc/rpc/transport/tcp/tcp_transport.h"

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

using Clock = std::chrono::steady_clock;

// What the connection's callbacks and the calling threads share.
struct Shared {
  std::mutex mutex;
  std::condition_variable changed;
  std::shared_ptr<Connection> connection; // null: none open
  uint64_t generation = 0; // counts connections; a failure bumps it too
  std::string lastError;
  // Replies of the calls still waiting; others are dropped.
  std::set<uint64_t> awaited;
  std::map<uint64_t, store::StoreReply> replies;
  // Whether the server has answered a call: from then on, a server that
  // refuses connections has gone away rather than not started yet.
  bool served = false;
};

class StoreClient : public RendezvousStore {
 public:
  explicit StoreClient(StoreClientOptions options)
      : options_(std::move(options)),
        shared_(std::make_shared<Shared>()) {
    TcpTransportOptions transportOptions;
    transportOptions.listenAddress = "127.0.0.1";
    transportOptions.name = "rendezvous-store-client";
    transportOptions.sharedSecret = options_.sharedSecret;
    transportOptions.handshakeTimeout = options_.handshakeTimeout;
    transportOptions.heartbeatInterval = options_.heartbeatInterval;
    transportOptions.peerTimeout = options_.peerTimeout;
    transportOptions.sameHostZeroCopy = false;
    // Replies are small: a value at most (StoreLimits).
    transportOptions.limits.maxHeaderBytes = StoreLimits().maxRequestBytes();
    transportOptions.limits.maxMessageBytes = StoreLimits().maxRequestBytes();
    transportOptions.limits.maxTensorsPerMessage = 0;
    transport_ = std::make_unique<TcpTransport>(transportOptions);
  }

  ~StoreClient() override {
    transport_->close();
    transport_->join();
  }

  void set(const std::string& key, const std::string& value) override {
    store::StoreRequest request;
    request.mutable_set()->set_key(key);
    request.mutable_set()->set_value(value);
    expectOk(call(request, "set(" + key + ")", giveUp()), "set(" + key + ")");
  }

  bool setBefore(
      const std::string& key,
      const std::string& value,
      Clock::time_point deadline) override {
    store::StoreRequest request;
    request.mutable_set()->set_key(key);
    request.mutable_set()->set_value(value);
    bool gone = false;
    auto reply = call(
        request,
        "set(" + key + ")",
        std::min(giveUp(), deadline),
        std::nullopt,
        &gone);
    if (gone) {
      return false;
    }
    expectOk(reply, "set(" + key + ")");
    return true;
  }

  std::string get(const std::string& key) override {
    store::StoreRequest request;
    request.mutable_get()->set_key(key);
    auto reply = call(request, "get(" + key + ")", giveUp());
    expectOk(reply, "get(" + key + ")");
    TORCH_CHECK(reply->found(), describe(), " has no key '", key, "'");
    return reply->value();
  }

  int64_t add(const std::string& key, int64_t delta) override {
    store::StoreRequest request;
    request.mutable_add()->set_key(key);
    request.mutable_add()->set_delta(delta);
    auto reply = call(request, "add(" + key + ")", giveUp());
    expectOk(reply, "add(" + key + ")");
    return reply->number();
  }

  bool check(const std::vector<std::string>& keys) override {
    store::StoreRequest request;
    for (const auto& key : keys) {
      request.mutable_check()->add_keys(key);
    }
    auto reply = call(request, "check", giveUp());
    expectOk(reply, "check");
    return reply->found();
  }

  bool wait(
      const std::vector<std::string>& keys,
      std::chrono::milliseconds timeout) override {
    store::StoreRequest request;
    for (const auto& key : keys) {
      request.mutable_wait()->add_keys(key);
    }
    auto waitDeadline = Clock::now() + timeout;
    auto reply =
        call(request, "wait", std::max(giveUp(), waitDeadline), waitDeadline);
    if (!reply) {
      return false;
    }
    expectOk(reply, "wait");
    return true;
  }

  std::string describe() const override {
    return "the rendezvous store at " + options_.address;
  }

 private:
  void expectOk(
      const std::optional<store::StoreReply>& reply,
      const std::string& what) const {
    TORCH_CHECK(reply, describe(), " did not answer ", what);
    TORCH_CHECK(
        reply->error().empty(),
        describe(),
        " refused ",
        what,
        ": ",
        reply->error());
  }

  // The open connection, or a new one.
  std::pair<std::shared_ptr<Connection>, uint64_t> connection() {
    {
      std::lock_guard<std::mutex> guard(shared_->mutex);
      if (shared_->connection) {
        return {shared_->connection, shared_->generation};
      }
    }
    auto connection = transport_->connect(options_.address);
    uint64_t generation = 0;
    {
      std::lock_guard<std::mutex> guard(shared_->mutex);
      generation = ++shared_->generation;
      shared_->connection = connection;
    }
    std::weak_ptr<Shared> weak = shared_;
    connection->start(
        [weak](Message&& message) {
          auto shared = weak.lock();
          store::StoreReply reply;
          if (!shared || !message.tensors.empty() ||
              !reply.ParseFromString(message.header)) {
            return; // a reply that does not parse is lost: the call times out
          }
          std::lock_guard<std::mutex> guard(shared->mutex);
          if (shared->awaited.count(reply.id()) > 0) {
            shared->replies[reply.id()] = std::move(reply);
            shared->changed.notify_all();
          }
        },
        [weak, generation](const TransportError& error) {
          auto shared = weak.lock();
          if (!shared) {
            return;
          }
          std::lock_guard<std::mutex> guard(shared->mutex);
          if (shared->generation == generation) {
            shared->connection.reset();
            ++shared->generation;
          }
          shared->lastError = error.detail;
          shared->changed.notify_all();
        });
    return {connection, generation};
  }

  // Sends `request` and waits for its reply, reconnecting while the server
  // is unreachable, and throws once `giveUp` passes. With a waitDeadline (a
  // wait), nullopt when it passes first (the server is told to drop the
  // wait). A server that has answered this client and then loses the
  // connection and refuses a new one has gone away (rank 0 left or died):
  // waiting longer cannot help, so that ends the call at once, as nullopt
  // with *gone set when the caller asked, as an error otherwise.
  std::optional<store::StoreReply> call(
      store::StoreRequest& request,
      const std::string& what,
      Clock::time_point giveUp,
      std::optional<Clock::time_point> waitDeadline = std::nullopt,
      bool* gone = nullptr) {
    const auto start = Clock::now();
    auto backoff = std::chrono::milliseconds(20);
    int failuresSinceServed = 0;
    while (true) {
      // Not a structured binding: C++17 does not let the lambda below
      // capture one (clang refuses it; tools/fuzz.sh builds with clang).
      auto current = this->connection();
      auto connection = std::move(current.first);
      const uint64_t generation = current.second;
      uint64_t id = nextId_.fetch_add(1);
      request.set_id(id);
      {
        std::lock_guard<std::mutex> guard(shared_->mutex);
        shared_->awaited.insert(id);
      }
      Message message;
      message.header = request.SerializeAsString();
      connection->send(std::move(message), [](const TransportError*) {});

      auto deadline = waitDeadline ? std::min(*waitDeadline, giveUp) : giveUp;
      std::unique_lock<std::mutex> lock(shared_->mutex);
      bool settled = shared_->changed.wait_until(lock, deadline, [&] {
        return shared_->replies.count(id) > 0 ||
            shared_->generation != generation;
      });
      shared_->awaited.erase(id);
      auto it = shared_->replies.find(id);
      if (it != shared_->replies.end()) {
        store::StoreReply reply = std::move(it->second);
        shared_->replies.erase(it);
        shared_->served = true;
        return reply;
      }
      std::string lastError = shared_->lastError;
      const bool served = shared_->served;
      lock.unlock();
      if (!settled) {
        if (waitDeadline && *waitDeadline <= giveUp) {
          store::StoreRequest cancel;
          cancel.mutable_cancel_wait()->set_wait_id(id);
          Message cancelMessage;
          cancelMessage.header = cancel.SerializeAsString();
          connection->send(std::move(cancelMessage), [](const TransportError*) {
          });
          return std::nullopt;
        }
        // Never answered, and the last connection failed (a wrong secret,
        // nothing listening): its cause says more than the silence of the
        // attempt the deadline cut short.
        if (!served && !lastError.empty()) {
          throwUnreachable(what, start, lastError);
        }
        TORCH_CHECK(
            false,
            describe(),
            " did not answer ",
            what,
            " within ",
            std::chrono::duration_cast<std::chrono::milliseconds>(
                Clock::now() - start)
                .count(),
            " ms");
      }
      // The connection failed: the server is not up yet, went away for a
      // moment, or is gone for good.
      if (served && ++failuresSinceServed >= 2) {
        if (gone != nullptr) {
          *gone = true;
          return std::nullopt;
        }
        TORCH_CHECK(
            false,
            describe(),
            " has gone away (it closed the connection and refuses new "
            "ones; has rank 0 stopped?) during ",
            what,
            ": ",
            lastError);
      }
      auto now = Clock::now();
      auto end = waitDeadline ? std::min(*waitDeadline, giveUp) : giveUp;
      if (now + backoff >= end) {
        if (waitDeadline && *waitDeadline <= giveUp) {
          return std::nullopt;
        }
        throwUnreachable(what, start, lastError);
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
    }
  }

  // Throws: "cannot reach" the store, with the last connection's failure.
  void throwUnreachable(
      const std::string& what,
      Clock::time_point start,
      const std::string& lastError) const {
    TORCH_CHECK(
        false,
        "cannot reach ",
        describe(),
        " for ",
        what,
        " within ",
        std::chrono::duration_cast<std::chrono::milliseconds>(
            Clock::now() - start)
            .count(),
        " ms: ",
        lastError);
  }

  Clock::time_point giveUp() const {
    return Clock::now() + options_.timeout;
  }

  const StoreClientOptions options_;
  std::shared_ptr<Shared> shared_;
  std::unique_ptr<TcpTransport> transport_;
  std::atomic<uint64_t> nextId_{1};
};

} // namespace

std::unique_ptr<RendezvousStore> connectToStore(StoreClientOptions options) {
  return std::make_unique<StoreClient>(std::move(options));
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
