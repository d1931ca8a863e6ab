#include "torchrpc/rpc/transport/inprocess/inprocess_transport.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <queue>
#include <thread>
#include <utility>
#include <vector>

#include "torchrpc/rpc/transport/receive_buffer_pool.h"

namespace torchrpc {
namespace rpc {

namespace detail {

namespace {

using Clock = std::chrono::steady_clock;

// One thread running tasks in (due time, submission) order. Ties keep FIFO
// order, which is what keeps a connection's deliveries ordered.
class TimedExecutor {
 public:
  TimedExecutor() : thread_([this]() { run(); }) {}

  ~TimedExecutor() {
    stop();
    if (thread_.get_id() == std::this_thread::get_id()) {
      // The last task dropped the last reference: we cannot join ourselves.
      thread_.detach();
    } else if (thread_.joinable()) {
      thread_.join();
    }
  }

  // False once stopped: the task was not queued and never runs.
  bool post(std::function<void()> task, Clock::time_point due) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      return false;
    }
    tasks_.push(Task{due, nextSeq_++, std::move(task)});
    cv_.notify_one();
    return true;
  }

  bool post(std::function<void()> task) {
    return post(std::move(task), Clock::now());
  }

  bool inThread() const {
    return thread_.get_id() == std::this_thread::get_id();
  }

  // Runs what is queued right away, ignoring due times, then ends the
  // thread. Later posts are refused.
  void stop() {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    cv_.notify_one();
  }

  void join() {
    stop();
    if (thread_.joinable() && !inThread()) {
      thread_.join();
    }
  }

 private:
  struct Task {
    Clock::time_point due;
    uint64_t seq;
    std::function<void()> fn;
  };
  struct Later {
    bool operator()(const Task& a, const Task& b) const {
      return a.due != b.due ? a.due > b.due : a.seq > b.seq;
    }
  };

  void run() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      if (tasks_.empty()) {
        if (stopping_) {
          return;
        }
        cv_.wait(lock);
        continue;
      }
      if (!stopping_ && tasks_.top().due > Clock::now()) {
        // A copy: wait_until reads its argument while unlocked, and a post()
        // meanwhile may move the queue's storage.
        Clock::time_point due = tasks_.top().due;
        cv_.wait_until(lock, due);
        continue;
      }
      std::function<void()> fn = std::move(const_cast<Task&>(tasks_.top()).fn);
      tasks_.pop();
      lock.unlock();
      fn();
      fn = nullptr; // captured state dies outside the lock too
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::priority_queue<Task, std::vector<Task>, Later> tasks_;
  uint64_t nextSeq_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

// What an endpoint needs from the transport that owns it. Shared so that a
// connection kept by the user outlives the transport safely.
struct EndpointContext {
  std::shared_ptr<TimedExecutor> executor;
  std::shared_ptr<ReceiveBufferPool> pool;
  std::shared_ptr<InProcessNetwork> network;
  TransportLimits limits;
  std::string address;
  // For InProcessTransport::stats(): every tensor is copied into a fresh
  // buffer on the way, as a real transport would deliver it.
  std::atomic<uint64_t> copiedBytes{0};
};

// Runs `done` on the executor, or inline when no thread is left.
void completeSend(
    TimedExecutor& executor,
    Connection::SendCallback done,
    std::shared_ptr<TransportError> error) {
  auto task = [done{std::move(done)}, error]() { done(error.get()); };
  auto copy = task;
  if (!executor.post(std::move(task))) {
    copy();
  }
}

std::shared_ptr<TransportError> makeError(ErrorCode code, std::string detail) {
  return std::make_shared<TransportError>(
      TransportError{code, std::move(detail)});
}

} // namespace

// One end of an in-process connection. Its callbacks (and everything that
// touches inbox_ or the user callbacks) run on its owner's executor.
class InProcessConnection
    : public Connection,
      public std::enable_shared_from_this<InProcessConnection> {
 public:
  InProcessConnection(
      std::shared_ptr<EndpointContext> context,
      std::string remoteAddress)
      : context_(std::move(context)),
        remoteAddress_(std::move(remoteAddress)) {}

  ~InProcessConnection() override {
    // Dropping a connection closes it, as a socket would.
    std::shared_ptr<InProcessConnection> peer;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      peer = peer_.lock();
    }
    if (peer) {
      peer->failAfterInFlight(TransportError{
          ErrorCode::kWorkerUnavailable,
          "peer " + context_->address + " dropped the connection"});
    }
  }

  // Links this side to its peer. A side that failed before it was linked
  // (its transport closed during connect() or accept()) could not tell the
  // peer then; it does now, as close() would have.
  void setPeer(const std::weak_ptr<InProcessConnection>& peer) {
    bool failed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      peer_ = peer;
      failed = failed_;
    }
    if (failed) {
      closePeer("peer " + context_->address + " closed the connection");
    }
  }

  void start(ReceiveCallback onMessage, ErrorCallback onError) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_CHECK(!started_, "Connection::start() called twice");
      started_ = true;
      onMessage_ = std::move(onMessage);
      onError_ = std::move(onError);
    }
    schedulePump(Clock::now());
  }

  void send(Message&& message, SendCallback done) override {
    for (const at::Tensor& tensor : message.tensors) {
      TORCH_CHECK(
          tensor.device().is_cpu() && tensor.is_contiguous(),
          "InProcessTransport sends contiguous CPU tensors only");
    }
    std::shared_ptr<InProcessConnection> peer;
    std::shared_ptr<TransportError> failure;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      peer = peer_.lock();
      if (failed_) {
        failure = std::make_shared<TransportError>(error_);
      } else if (!peer) {
        failure = makeError(
            ErrorCode::kWorkerUnavailable,
            "connection to " + remoteAddress_ + " is not open");
      }
    }
    if (failure) {
      completeSend(*context_->executor, std::move(done), failure);
      return;
    }
    FaultAction action =
        context_->network->decide(context_->address, remoteAddress_, message);
    switch (action.kind) {
      case FaultAction::Kind::kDrop:
        completeSend(*context_->executor, std::move(done), nullptr);
        return;
      case FaultAction::Kind::kFailConnection: {
        TransportError error{
            ErrorCode::kWorkerUnavailable,
            "connection " + context_->address + " -> " + remoteAddress_ +
                " failed by the fault injector"};
        failNow(error);
        peer->failNow(error);
        completeSend(
            *context_->executor,
            std::move(done),
            std::make_shared<TransportError>(error));
        return;
      }
      case FaultAction::Kind::kDeliver:
      case FaultAction::Kind::kDelay:
        peer->receive(std::move(message), action.delay, /*keepOrder=*/true);
        completeSend(*context_->executor, std::move(done), nullptr);
        return;
      case FaultAction::Kind::kDelayOutOfOrder:
        peer->receive(std::move(message), action.delay, /*keepOrder=*/false);
        completeSend(*context_->executor, std::move(done), nullptr);
        return;
    }
  }

  void close() override {
    TransportError error{
        ErrorCode::kWorkerUnavailable,
        "connection " + context_->address + " -> " + remoteAddress_ +
            " closed locally"};
    if (!failNow(error)) {
      return;
    }
    closePeer("peer " + context_->address + " closed the connection");
  }

  std::string describe() const override {
    return remoteAddress_;
  }

  const std::string& localAddress() const {
    return context_->address;
  }

  // Fails this side now: nothing more is delivered. False if it had failed.
  bool failNow(const TransportError& error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failed_) {
        return false;
      }
      failed_ = true;
      error_ = error;
    }
    schedulePump(Clock::now());
    return true;
  }

  // Fails this side once what the peer sent before has been delivered, the
  // way a FIN follows the data on a socket.
  void failAfterInFlight(const TransportError& error) {
    Clock::time_point due;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      due = std::max(Clock::now(), deliverNotBefore_);
    }
    std::weak_ptr<InProcessConnection> weakSelf = weak_from_this();
    postOrDrop(
        [weakSelf, error]() {
          if (auto self = weakSelf.lock()) {
            self->failNow(error);
          }
        },
        due);
  }

 private:
  // Called on the sender's thread: checks this side's caps, copies the
  // bytes into this side's buffers and schedules the delivery.
  void receive(
      Message&& message,
      std::chrono::milliseconds delay,
      bool keepOrder) {
    const TransportLimits& limits = context_->limits;
    std::string violation;
    size_t total = message.header.size();
    if (message.header.size() > limits.maxHeaderBytes) {
      violation = "header of " + std::to_string(message.header.size()) +
          " bytes exceeds the cap of " + std::to_string(limits.maxHeaderBytes);
    } else if (message.tensors.size() > limits.maxTensorsPerMessage) {
      violation = std::to_string(message.tensors.size()) +
          " tensors exceed the cap of " +
          std::to_string(limits.maxTensorsPerMessage);
    } else {
      for (const at::Tensor& tensor : message.tensors) {
        total += tensor.nbytes();
      }
      if (total > limits.maxMessageBytes) {
        violation = "message of " + std::to_string(total) +
            " bytes exceeds the cap of " +
            std::to_string(limits.maxMessageBytes);
      }
    }

    std::shared_ptr<Message> copy;
    if (violation.empty()) {
      copy = std::make_shared<Message>();
      copy->header = std::move(message.header);
      copy->tensors.reserve(message.tensors.size());
      for (const at::Tensor& tensor : message.tensors) {
        size_t nbytes = tensor.nbytes();
        at::Tensor buffer = context_->pool->allocate(nbytes);
        if (nbytes > 0) {
          std::memcpy(buffer.data_ptr(), tensor.data_ptr(), nbytes);
        }
        context_->copiedBytes.fetch_add(nbytes, std::memory_order_relaxed);
        copy->tensors.push_back(std::move(buffer));
      }
    }

    Clock::time_point due;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (keepOrder) {
        due = std::max(Clock::now() + delay, deliverNotBefore_);
        deliverNotBefore_ = due;
      } else {
        due = Clock::now() + delay;
      }
    }
    std::weak_ptr<InProcessConnection> weakSelf = weak_from_this();
    postOrDrop(
        [weakSelf, copy, violation]() {
          auto self = weakSelf.lock();
          if (!self) {
            return;
          }
          if (!violation.empty()) {
            if (self->failNow(TransportError{
                    ErrorCode::kMalformedMessage,
                    "from " + self->remoteAddress_ + ": " + violation})) {
              self->closePeer(
                  "peer " + self->context_->address +
                  " closed the connection: " + violation);
            }
            return;
          }
          {
            std::lock_guard<std::mutex> lock(self->mutex_);
            if (self->failed_) {
              return;
            }
            self->inbox_.push_back(std::move(*copy));
          }
          self->pump();
        },
        due);
  }

  void closePeer(const std::string& detail) {
    std::shared_ptr<InProcessConnection> peer;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      peer = peer_.lock();
    }
    if (peer) {
      peer->failAfterInFlight(
          TransportError{ErrorCode::kWorkerUnavailable, detail});
    }
  }

  void postOrDrop(std::function<void()> task, Clock::time_point due) {
    // A refused post means the owner joined; its connections have failed.
    context_->executor->post(std::move(task), due);
  }

  void schedulePump(Clock::time_point due) {
    std::weak_ptr<InProcessConnection> weakSelf = weak_from_this();
    bool posted = context_->executor->post(
        [weakSelf]() {
          if (auto self = weakSelf.lock()) {
            self->pump();
          }
        },
        due);
    if (!posted) {
      // The owner has joined: no delivery thread is left to report the
      // error, so it is reported here (see the NB in the header).
      pump();
    }
  }

  // On the executor: delivers what is in the inbox, or reports the error.
  // The user callbacks are only touched here, so no lock is held while
  // they run.
  void pump() {
    while (true) {
      Message message;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!started_) {
          return;
        }
        if (failed_) {
          if (reported_) {
            return;
          }
          reported_ = true;
          inbox_.clear();
          break;
        }
        if (inbox_.empty()) {
          return;
        }
        message = std::move(inbox_.front());
        inbox_.pop_front();
      }
      onMessage_(std::move(message));
    }
    // Drop the callbacks: they often capture this connection.
    ErrorCallback onError = std::move(onError_);
    TransportError error;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      error = error_;
    }
    onError_ = nullptr;
    onMessage_ = nullptr;
    if (onError) {
      onError(error);
    }
  }

  const std::shared_ptr<EndpointContext> context_;
  const std::string remoteAddress_;

  std::mutex mutex_;
  std::weak_ptr<InProcessConnection> peer_;
  bool started_ = false;
  bool failed_ = false;
  bool reported_ = false;
  TransportError error_;
  std::deque<Message> inbox_;
  Clock::time_point deliverNotBefore_{};
  // Set in start(), cleared in pump(); both on the executor after start().
  ReceiveCallback onMessage_;
  ErrorCallback onError_;
};

class InProcessTransportImpl
    : public std::enable_shared_from_this<InProcessTransportImpl> {
 public:
  InProcessTransportImpl(
      std::shared_ptr<InProcessNetwork> network,
      TransportLimits limits)
      : context_(std::make_shared<EndpointContext>()) {
    TORCH_CHECK(network != nullptr, "InProcessTransport needs a network");
    context_->executor = std::make_shared<TimedExecutor>();
    context_->pool = ReceiveBufferPool::create();
    context_->limits = limits;
    context_->address = network->allocateAddress();
    context_->network = std::move(network);
  }

  const std::string& address() const {
    return context_->address;
  }

  TransportStats stats() const {
    TransportStats out;
    out.copiedBytes = context_->copiedBytes.load(std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& weak : connections_) {
      out.connectionsOpen += weak.expired() ? 0 : 1;
    }
    return out;
  }

  void listen(Transport::AcceptCallback onAccept) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_CHECK(!closed_, "InProcessTransport::listen() after close()");
      TORCH_CHECK(!listening_, "InProcessTransport::listen() called twice");
      listening_ = true;
      onAccept_ =
          std::make_shared<Transport::AcceptCallback>(std::move(onAccept));
    }
    context_->network->bind(context_->address, weak_from_this());
  }

  std::shared_ptr<Connection> connect(const std::string& address) {
    auto local = std::make_shared<InProcessConnection>(context_, address);
    bool closed;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closed = closed_;
      if (!closed) {
        track(local);
      }
    }
    if (closed) {
      local->failNow(TransportError{
          ErrorCode::kWorkerUnavailable,
          "transport " + context_->address + " is closed"});
      return local;
    }
    std::shared_ptr<InProcessConnection> remote;
    if (auto listener = context_->network->lookup(address)) {
      remote = listener->accept(local);
    }
    if (!remote) {
      local->failNow(TransportError{
          ErrorCode::kWorkerUnavailable,
          "nothing listens at " + address + " on this InProcessNetwork"});
      return local;
    }
    local->setPeer(remote);
    return local;
  }

  void close() {
    std::vector<std::weak_ptr<InProcessConnection>> connections;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) {
        return;
      }
      closed_ = true;
      connections.swap(connections_);
    }
    context_->network->unbind(context_->address);
    for (auto& weak : connections) {
      if (auto connection = weak.lock()) {
        connection->close();
      }
    }
  }

  void join() {
    close();
    TORCH_CHECK(
        !context_->executor->inThread(),
        "InProcessTransport::join() called from its own callback");
    context_->executor->join();
    std::lock_guard<std::mutex> lock(mutex_);
    onAccept_.reset();
  }

  // A connect() to this transport's address lands here. Null if not
  // accepting.
  std::shared_ptr<InProcessConnection> accept(
      const std::shared_ptr<InProcessConnection>& connector) {
    auto accepted = std::make_shared<InProcessConnection>(
        context_,
        connector->localAddress());
    std::shared_ptr<Transport::AcceptCallback> onAccept;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_ || !listening_) {
        return nullptr;
      }
      track(accepted);
      onAccept = onAccept_;
    }
    accepted->setPeer(connector);
    context_->executor->post([onAccept, accepted]() { (*onAccept)(accepted); });
    return accepted;
  }

 private:
  // Under mutex_.
  void track(const std::shared_ptr<InProcessConnection>& connection) {
    if (connections_.size() >= 2 * trackedAtLastPrune_ + 16) {
      // Forget dead connections now and then, so that churn stays bounded.
      std::vector<std::weak_ptr<InProcessConnection>> alive;
      for (auto& weak : connections_) {
        if (!weak.expired()) {
          alive.push_back(std::move(weak));
        }
      }
      connections_.swap(alive);
      trackedAtLastPrune_ = connections_.size();
    }
    connections_.push_back(connection);
  }

  const std::shared_ptr<EndpointContext> context_;
  mutable std::mutex mutex_;
  bool listening_ = false;
  bool closed_ = false;
  std::shared_ptr<Transport::AcceptCallback> onAccept_;
  std::vector<std::weak_ptr<InProcessConnection>> connections_;
  size_t trackedAtLastPrune_ = 0;
};

} // namespace detail

InProcessTransport::InProcessTransport(
    std::shared_ptr<InProcessNetwork> network,
    TransportLimits limits)
    : impl_(std::make_shared<detail::InProcessTransportImpl>(
          std::move(network),
          limits)) {}

InProcessTransport::~InProcessTransport() {
  impl_->join();
}

std::string InProcessTransport::name() const {
  return "inprocess";
}

void InProcessTransport::listen(AcceptCallback onAccept) {
  impl_->listen(std::move(onAccept));
}

std::string InProcessTransport::address() const {
  return impl_->address();
}

std::shared_ptr<Connection> InProcessTransport::connect(
    const std::string& address) {
  return impl_->connect(address);
}

void InProcessTransport::close() {
  impl_->close();
}

void InProcessTransport::join() {
  impl_->join();
}

TransportStats InProcessTransport::stats() const {
  return impl_->stats();
}

} // namespace rpc
} // namespace torchrpc
