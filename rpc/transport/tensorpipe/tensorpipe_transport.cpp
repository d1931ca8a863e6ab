#include "torchrpc/rpc/transport/tensorpipe/tensorpipe_transport.h"

#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <tensorpipe/tensorpipe.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <signal.h>
#include <unistd.h>

#include <condition_variable>
#include <deque>
#include <future>
#include <mutex>
#include <random>
#include <thread>
#include <utility>

#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/log_level.h"
#include "torchrpc/rpc/transport/receive_buffer_pool.h"

namespace torchrpc {
namespace rpc {
namespace detail {

namespace tp = tensorpipe;

namespace {

// Priorities as PyTorch's agent uses them: the fastest option both sides
// support wins; basic is the fallback that always works.
constexpr int64_t kUvPriority = 0;
constexpr int64_t kShmPriority = 200;
constexpr int64_t kBasicPriority = 0;
constexpr int64_t kMptPriority = 1100;
constexpr int64_t kCmaPriority = 1200;

// Note [Small tensors travel as payloads]
// A tensor given to a TensorPipe channel costs that channel's own control
// messages and, for cma, a hand-off to the channel's thread: for a call with
// a few bytes of tensor data that doubled the cost of the call. Tensors up to
// kMaxInlineTensorBytes therefore go as payloads of the message, on the
// connection that carries the header; larger ones go to the channels. The
// message's metadata says, per wire tensor in order, which way it went
// (kInlineTensor or kChannelTensor); the receiver checks that layout
// against the descriptor before it allocates anything.
constexpr size_t kMaxInlineTensorBytes = 64 * 1024;
constexpr char kInlineTensor = 'p';
constexpr char kChannelTensor = 't';

// The thread through which this transport listens, closes and joins.
// TensorPipe runs its loop on whichever thread enters it; for these rare,
// possibly slow operations we keep that off the caller's thread (sends and
// connects go straight to TensorPipe, see tensorpipe_transport.h).
class SerialExecutor {
 public:
  SerialExecutor() : thread_([this]() { run(); }) {}

  ~SerialExecutor() {
    join();
    if (thread_.joinable()) {
      // Only when the last reference died on this very thread.
      thread_.detach();
    }
  }

  // False once joined: the task was not queued and never runs.
  bool post(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) {
      return false;
    }
    tasks_.push_back(std::move(task));
    cv_.notify_one();
    return true;
  }

  bool inThread() const {
    return thread_.get_id() == std::this_thread::get_id();
  }

  // Runs what is queued, then ends the thread.
  void join() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable() && !inThread()) {
      thread_.join();
    }
  }

 private:
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
      std::function<void()> task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      task = nullptr;
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stopping_ = false;
  std::thread thread_;
};

TransportError fromTensorPipe(const tp::Error& error, const std::string& who) {
  // Whatever TensorPipe reports (EOF, refused, reset, closed) means the
  // peer cannot be reached through this pipe any more.
  return TransportError{
      ErrorCode::kWorkerUnavailable,
      who + ": " + error.what()};
}

std::string uniqueShmAddress() {
  // Abstract socket names are per host: pid and randomness keep them apart.
  std::random_device random;
  return "torchrpc-" + std::to_string(::getpid()) + "-" +
      std::to_string(random()) + std::to_string(random());
}

// Blocks SIGPIPE on this thread while it lives, so that the threads it
// starts (TensorPipe's loops, our executor) inherit the blocked mask: a write
// to a socket whose peer is gone then fails with EPIPE instead of killing
// the process, without changing the process-wide signal disposition.
class ScopedBlockSigpipe {
 public:
  ScopedBlockSigpipe() {
    sigset_t block;
    sigemptyset(&block);
    sigaddset(&block, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &block, &previous_);
  }
  ~ScopedBlockSigpipe() {
    pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }

 private:
  sigset_t previous_;
};

std::string urlHost(const std::string& ip) {
  return ip.find(':') != std::string::npos ? "[" + ip + "]" : ip;
}

struct ConnectionContext {
  std::shared_ptr<SerialExecutor> executor;
  std::shared_ptr<ReceiveBufferPool> pool;
  TransportLimits limits;
  std::string name;
  // For TensorPipeTransport::stats(). TensorPipe reads tensors from their
  // storage and writes them into the buffers that become the received
  // tensors, whichever channel carries them: no copy in user space.
  std::atomic<uint64_t> tensorBytes{0};
  std::atomic<int64_t> connectionsOpen{0};
};

} // namespace

// One Connection over one tensorpipe::Pipe.
//
// All TensorPipe calls are made on the executor or inside TensorPipe
// callbacks; user callbacks run only inside TensorPipe callbacks (which
// TensorPipe serializes per context) except when no pipe exists, so
// onMessage and onError never overlap. TensorPipe callbacks hold a weak_ptr:
// once the user drops the connection they do nothing.
class TensorPipeConnection
    : public Connection,
      public std::enable_shared_from_this<TensorPipeConnection> {
 public:
  TensorPipeConnection(
      std::shared_ptr<ConnectionContext> context,
      std::string peer,
      std::shared_ptr<tp::Pipe> pipe)
      : context_(std::move(context)),
        peer_(std::move(peer)),
        pipe_(std::move(pipe)) {
    context_->connectionsOpen.fetch_add(1, std::memory_order_relaxed);
  }

  ~TensorPipeConnection() override {
    context_->connectionsOpen.fetch_sub(1, std::memory_order_relaxed);
    if (!pipe_) {
      return;
    }
    // Close on the executor: closing may run TensorPipe's loop (and other
    // connections' callbacks) on the calling thread.
    std::shared_ptr<tp::Pipe> pipe = std::move(pipe_);
    context_->executor->post([pipe]() { pipe->close(); });
  }

  // Before the connection is handed out.
  void setPipe(std::shared_ptr<tp::Pipe> pipe) {
    pipe_ = std::move(pipe);
  }

  // For a connection that never got a pipe.
  void failWithoutPipe(TransportError error) {
    std::lock_guard<std::mutex> lock(mutex_);
    failed_ = true;
    error_ = std::move(error);
  }

  void start(ReceiveCallback onMessage, ErrorCallback onError) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_CHECK(!started_, "Connection::start() called twice");
      started_ = true;
      onMessage_ = std::move(onMessage);
      onError_ = std::move(onError);
    }
    if (pipe_) {
      // A failed pipe fails this read at once, which reports the error.
      readNext();
    } else {
      TransportError error;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        error = error_;
      }
      fail(error);
    }
  }

  void send(Message&& message, SendCallback done) override {
    for (const at::Tensor& tensor : message.tensors) {
      TORCH_CHECK(
          tensor.device().is_cpu() && tensor.is_contiguous(),
          "TensorPipeTransport sends contiguous CPU tensors only");
    }
    // Keeps header and tensors alive until TensorPipe is done with them.
    // TensorPipe hands the write to its own loop, so no hop of ours is
    // needed (each costs a thread wake-up, the main part of a round trip).
    write(std::make_shared<Message>(std::move(message)), done);
  }

  void close() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closedLocally_ = true;
    }
    // The pending read then fails, which reports the error from TensorPipe's
    // loop, serialized with deliveries.
    std::weak_ptr<TensorPipeConnection> weakSelf = weak_from_this();
    auto task = [weakSelf]() {
      auto self = weakSelf.lock();
      if (self && self->pipe_) {
        self->pipe_->close();
      }
    };
    if (!context_->executor->post(task)) {
      failWithoutPipe(
          TransportError{ErrorCode::kWorkerUnavailable, "closed locally"});
    }
  }

  std::string describe() const override {
    return peer_;
  }

 private:
  void readNext() {
    std::weak_ptr<TensorPipeConnection> weakSelf = weak_from_this();
    pipe_->readDescriptor(
        [weakSelf](const tp::Error& error, tp::Descriptor descriptor) {
          if (auto self = weakSelf.lock()) {
            self->onDescriptor(error, std::move(descriptor));
          }
        });
  }

  // Checks the caps before anything is allocated. Empty if fine.
  std::string checkDescriptor(const tp::Descriptor& descriptor) const {
    const TransportLimits& limits = context_->limits;
    // See Note [Small tensors travel as payloads].
    const std::string& layout = descriptor.metadata;
    if (layout.size() > limits.maxTensorsPerMessage) {
      return std::to_string(layout.size()) + " tensors exceed the cap of " +
          std::to_string(limits.maxTensorsPerMessage);
    }
    size_t inlined = static_cast<size_t>(
        std::count(layout.begin(), layout.end(), kInlineTensor));
    size_t outOfBand = static_cast<size_t>(
        std::count(layout.begin(), layout.end(), kChannelTensor));
    if (descriptor.payloads.empty() || inlined + outOfBand != layout.size() ||
        descriptor.payloads.size() != 1 + inlined ||
        descriptor.tensors.size() != outOfBand) {
      return "unexpected message layout (" +
          std::to_string(descriptor.payloads.size()) + " payloads, " +
          std::to_string(descriptor.tensors.size()) + " tensors)";
    }
    size_t header = descriptor.payloads[0].length;
    if (header > limits.maxHeaderBytes) {
      return "header of " + std::to_string(header) +
          " bytes exceeds the cap of " + std::to_string(limits.maxHeaderBytes);
    }
    if (descriptor.tensors.size() > limits.maxTensorsPerMessage) {
      return std::to_string(descriptor.tensors.size()) +
          " tensors exceed the cap of " +
          std::to_string(limits.maxTensorsPerMessage);
    }
    size_t total = header;
    for (size_t i = 1; i < descriptor.payloads.size(); ++i) {
      size_t length = descriptor.payloads[i].length;
      if (length > limits.maxMessageBytes ||
          total + length > limits.maxMessageBytes) {
        return "message exceeds the cap of " +
            std::to_string(limits.maxMessageBytes) + " bytes";
      }
      total += length;
    }
    for (const tp::Descriptor::Tensor& tensor : descriptor.tensors) {
      if (tensor.sourceDevice.type != tp::kCpuDeviceType ||
          (tensor.targetDevice.has_value() &&
           tensor.targetDevice->type != tp::kCpuDeviceType)) {
        return "a tensor is not on the CPU";
      }
      // Compared one by one first so that the sum cannot wrap.
      if (tensor.length > limits.maxMessageBytes ||
          total + tensor.length > limits.maxMessageBytes) {
        return "message exceeds the cap of " +
            std::to_string(limits.maxMessageBytes) + " bytes";
      }
      total += tensor.length;
    }
    return std::string();
  }

  // onDescriptor and onRead run on TensorPipe's loop thread. No FromLoop
  // suffix: TensorPipe offers no public way to assert that (its inLoop() is
  // internal), and a name should not promise what nothing checks.
  void onDescriptor(const tp::Error& error, tp::Descriptor descriptor) {
    if (error) {
      failFromTensorPipe(error);
      return;
    }
    std::string violation = checkDescriptor(descriptor);
    if (!violation.empty()) {
      fail(TransportError{
          ErrorCode::kMalformedMessage,
          peer_ + ": " + violation});
      return;
    }
    auto holder = std::make_shared<Message>();
    tp::Allocation allocation;
    holder->header.resize(descriptor.payloads[0].length);
    allocation.payloads.push_back(tp::Allocation::Payload{&holder->header[0]});
    const std::string& layout = descriptor.metadata;
    holder->tensors.reserve(layout.size());
    size_t nextPayload = 1;
    size_t nextTensor = 0;
    for (char kind : layout) {
      bool inlined = kind == kInlineTensor;
      size_t length = inlined ? descriptor.payloads[nextPayload++].length
                              : descriptor.tensors[nextTensor++].length;
      at::Tensor buffer = context_->pool->allocate(length);
      context_->tensorBytes.fetch_add(length, std::memory_order_relaxed);
      if (inlined) {
        allocation.payloads.push_back(
            tp::Allocation::Payload{buffer.data_ptr()});
      } else {
        allocation.tensors.push_back(
            tp::Allocation::Tensor{tp::CpuBuffer{buffer.data_ptr()}});
      }
      holder->tensors.push_back(std::move(buffer));
    }
    std::weak_ptr<TensorPipeConnection> weakSelf = weak_from_this();
    pipe_->read(std::move(allocation), [weakSelf, holder](const tp::Error& e) {
      if (auto self = weakSelf.lock()) {
        self->onRead(e, std::move(*holder));
      }
    });
  }

  void onRead(const tp::Error& error, Message&& message) {
    if (error) {
      failFromTensorPipe(error);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (failed_) {
        return;
      }
    }
    onMessage_(std::move(message));
    readNext();
  }

  void write(const std::shared_ptr<Message>& holder, const SendCallback& done) {
    if (!pipe_) {
      TransportError error;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        error = error_;
      }
      done(&error);
      return;
    }
    tp::Message message;
    tp::Message::Payload header;
    // TensorPipe only reads from it; it wants a non-const pointer.
    header.data = const_cast<char*>(holder->header.data());
    header.length = holder->header.size();
    message.payloads.push_back(std::move(header));
    message.metadata.reserve(holder->tensors.size());
    for (const at::Tensor& tensor : holder->tensors) {
      context_->tensorBytes.fetch_add(
          tensor.nbytes(),
          std::memory_order_relaxed);
      void* data = const_cast<void*>(tensor.data_ptr());
      if (tensor.nbytes() <= kMaxInlineTensorBytes) {
        message.metadata.push_back(kInlineTensor);
        message.payloads.push_back(
            tp::Message::Payload{data, tensor.nbytes(), std::string()});
      } else {
        message.metadata.push_back(kChannelTensor);
        tp::Message::Tensor out;
        out.buffer = tp::CpuBuffer{data};
        out.length = tensor.nbytes();
        message.tensors.push_back(std::move(out));
      }
    }
    std::weak_ptr<TensorPipeConnection> weakSelf = weak_from_this();
    pipe_->write(
        std::move(message),
        [weakSelf, holder, done](const tp::Error& error) {
          if (!error) {
            done(nullptr);
            return;
          }
          TransportError failure;
          if (auto self = weakSelf.lock()) {
            failure = self->failFromTensorPipe(error);
          } else {
            failure = fromTensorPipe(error, "write");
          }
          done(&failure);
        });
  }

  // Returns the error that sticks on this connection.
  TransportError failFromTensorPipe(const tp::Error& error) {
    bool local;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      local = closedLocally_;
    }
    if (local) {
      return fail(TransportError{
          ErrorCode::kWorkerUnavailable,
          "connection to " + peer_ + " closed locally"});
    }
    return fail(fromTensorPipe(error, "connection to " + peer_));
  }

  // The first error sticks; onError runs once, after start().
  TransportError fail(const TransportError& error) {
    bool closePipe = false;
    ErrorCallback onError;
    TransportError sticky;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!failed_) {
        failed_ = true;
        error_ = error;
        closePipe = true;
      }
      if (started_ && !reported_) {
        reported_ = true;
        onError = std::move(onError_);
        onError_ = nullptr;
        // The callbacks often capture this connection: break the cycle.
        onMessage_ = nullptr;
      }
      sticky = error_;
    }
    if (closePipe && pipe_) {
      pipe_->close();
    }
    if (onError) {
      onError(sticky);
    }
    return sticky;
  }

  const std::shared_ptr<ConnectionContext> context_;
  const std::string peer_;
  // Written once before the connection is handed out (connect), or at
  // construction (accept).
  std::shared_ptr<tp::Pipe> pipe_;

  std::mutex mutex_;
  bool started_ = false;
  bool failed_ = false;
  bool reported_ = false;
  bool closedLocally_ = false;
  TransportError error_;
  // Called only inside TensorPipe callbacks (or with no pipe).
  ReceiveCallback onMessage_;
  ErrorCallback onError_;
};

class TensorPipeTransportImpl
    : public std::enable_shared_from_this<TensorPipeTransportImpl> {
 public:
  TransportStats stats() const {
    TransportStats out;
    out.zeroCopyBytes =
        connectionContext_->tensorBytes.load(std::memory_order_relaxed);
    out.connectionsOpen = static_cast<uint64_t>(std::max<int64_t>(
        0,
        connectionContext_->connectionsOpen.load(std::memory_order_relaxed)));
    return out;
  }

  explicit TensorPipeTransportImpl(TensorPipeTransportOptions options)
      : options_(std::move(options)),
        connectionContext_(std::make_shared<ConnectionContext>()) {
    // Every thread this transport owns starts below, in this scope.
    ScopedBlockSigpipe blockSigpipe;
    connectionContext_->executor = std::make_shared<SerialExecutor>();
    connectionContext_->pool = ReceiveBufferPool::create();
    connectionContext_->limits = options_.limits;
    connectionContext_->name = options_.name;
    context_ =
        std::make_shared<tp::Context>(tp::ContextOptions().name(options_.name));

    bool hasUv = false;
    for (const std::string& transport : options_.transports) {
      if (transport == "uv") {
        hasUv = true;
      } else if (transport == "shm") {
        context_->registerTransport(
            kShmPriority,
            "shm",
            tp::transport::shm::create());
        shm_ = true;
      } else {
        TORCH_CHECK(false, "unknown TensorPipe transport '", transport, "'");
      }
    }
    // The address peers connect to is always the uv one.
    (void)hasUv;
    context_->registerTransport(kUvPriority, "uv", tp::transport::uv::create());

    for (const std::string& channel : options_.channels) {
      if (channel == "cma") {
        context_->registerChannel(
            kCmaPriority,
            "cma",
            tp::channel::cma::create());
      } else if (channel == "mpt") {
        registerMpt();
      } else if (channel == "basic") {
        // Registered below in any case.
      } else if (channel == "xth") {
        TORCH_CHECK(
            false,
            "TensorPipe channel 'xth' works only within one process; "
            "use 'cma' or 'basic'");
      } else {
        TORCH_CHECK(false, "unknown TensorPipe channel '", channel, "'");
      }
    }
    context_->registerChannel(
        kBasicPriority,
        "basic",
        tp::channel::basic::create());
  }

  ~TensorPipeTransportImpl() = default;

  void listen(Transport::AcceptCallback onAccept) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      TORCH_CHECK(!closed_, "TensorPipeTransport::listen() after close()");
      TORCH_CHECK(!listening_, "TensorPipeTransport::listen() called twice");
      listening_ = true;
    }
    auto promise = std::make_shared<std::promise<void>>();
    std::future<void> listening = promise->get_future();
    auto self = shared_from_this();
    auto onAcceptShared =
        std::make_shared<Transport::AcceptCallback>(std::move(onAccept));
    bool posted =
        connectionContext_->executor->post([self, promise, onAcceptShared]() {
          try {
            self->listener_ = self->listenFromLoop(
                "uv://" + urlHost(self->options_.listenAddress));
            {
              // Before accepting: listening again needs the address.
              std::lock_guard<std::mutex> lock(self->mutex_);
              self->address_ = self->listener_->url("uv");
            }
            self->armAccept(self->listener_, onAcceptShared, 0);
            promise->set_value();
          } catch (...) {
            promise->set_exception(std::current_exception());
          }
        });
    TORCH_CHECK(posted, "TensorPipeTransport::listen() after join()");
    // Rethrows what listen threw (e.g. an address we cannot bind).
    listening.get();
  }

  std::string address() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return address_;
  }

  std::shared_ptr<Connection> connect(const std::string& address) {
    auto connection = std::make_shared<TensorPipeConnection>(
        connectionContext_,
        address,
        nullptr);
    bool schemeOk = address.rfind("uv://", 0) == 0 ||
        (shm_ && address.rfind("shm://", 0) == 0);
    if (!schemeOk) {
      connection->failWithoutPipe(TransportError{
          ErrorCode::kWorkerUnavailable,
          "not a TensorPipe address this transport can reach: '" + address +
              "'"});
      return connection;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) {
        connection->failWithoutPipe(TransportError{
            ErrorCode::kWorkerUnavailable,
            "transport " + options_.name + " is closed"});
        return connection;
      }
    }
    // TensorPipe's connect does not block: the pipe exists at once and
    // connects on TensorPipe's loop; a failure arrives through the pipe.
    try {
      connection->setPipe(
          context_->connect(address, tp::PipeOptions().remoteName(address)));
    } catch (const std::exception& e) {
      // E.g. an address that does not parse.
      connection->failWithoutPipe(TransportError{
          ErrorCode::kWorkerUnavailable,
          "cannot connect to " + address + ": " + describeException(e)});
    }
    return connection;
  }

  void close() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) {
        return;
      }
      closed_ = true;
    }
    auto self = shared_from_this();
    // Closing the context closes the listener and every pipe; their pending
    // callbacks then fire with errors, which fails each connection.
    connectionContext_->executor->post([self]() {
      if (self->listener_) {
        self->listener_->close();
      }
      self->context_->close();
    });
  }

  void join() {
    close();
    auto& executor = connectionContext_->executor;
    TORCH_CHECK(
        !executor->inThread(),
        "TensorPipeTransport::join() called from its own thread");
    auto self = shared_from_this();
    std::promise<void> joined;
    std::future<void> done = joined.get_future();
    if (executor->post([self, &joined]() {
          self->context_->join();
          self->listener_.reset();
          joined.set_value();
        })) {
      // TensorPipe's join waits for its loops; it is bounded by their
      // shutdown, which does not wait for peers.
      done.wait();
    }
    executor->join();
  }

 private:
  void registerMpt() {
    std::vector<std::shared_ptr<tp::transport::Context>> contexts;
    std::vector<std::shared_ptr<tp::transport::Listener>> listeners;
    for (int lane = 0; lane < options_.mptLanes; ++lane) {
      auto context = tp::transport::uv::create();
      listeners.push_back(context->listen(options_.listenAddress));
      contexts.push_back(std::move(context));
    }
    context_->registerChannel(
        kMptPriority,
        "mpt",
        tp::channel::mpt::create(std::move(contexts), std::move(listeners)));
  }

  // NB: TensorPipe's listener takes any error of a connection it accepts
  // (a port scan's EOF, a peer that does not speak TensorPipe) as its own
  // and stops accepting for good. So on such an error we listen again on
  // the same address, backing off a little while errors repeat.
  void armAccept(
      const std::shared_ptr<tp::Listener>& listener,
      const std::shared_ptr<Transport::AcceptCallback>& onAccept,
      int failures) {
    std::weak_ptr<TensorPipeTransportImpl> weakSelf = weak_from_this();
    std::weak_ptr<tp::Listener> weakListener = listener;
    listener->accept([weakSelf, weakListener, onAccept, failures](
                         const tp::Error& error,
                         std::shared_ptr<tp::Pipe> pipe) {
      auto self = weakSelf.lock();
      auto listener = weakListener.lock();
      if (!self || !listener) {
        return;
      }
      if (error) {
        if (error.isOfType<tp::ListenerClosedError>() ||
            error.isOfType<tp::ContextClosedError>()) {
          return;
        }
        TORCHRPC_LOG(kWarning)
            << "TensorPipeTransport " << self->options_.name
            << " listener failed (" << error.what() << "); listening again";
        self->connectionContext_->executor->post([self, onAccept, failures]() {
          self->relistenFromLoop(onAccept, failures + 1);
        });
        return;
      }
      std::string peer = pipe->getRemoteName();
      auto connection = std::make_shared<TensorPipeConnection>(
          self->connectionContext_,
          peer.empty() ? "accepted peer" : "peer of " + peer,
          std::move(pipe));
      // Re-arm first: a throwing or slow onAccept must not stop accepting.
      self->armAccept(listener, onAccept, 0);
      (*onAccept)(std::move(connection));
    });
  }

  // On the executor.
  std::shared_ptr<tp::Listener> listenFromLoop(const std::string& uvUrl) {
    TORCH_INTERNAL_ASSERT_DEBUG_ONLY(connectionContext_->executor->inThread());
    std::vector<std::string> urls = {uvUrl};
    if (shm_) {
      urls.push_back("shm://" + uniqueShmAddress());
    }
    return context_->listen(urls);
  }

  // On the executor.
  void relistenFromLoop(
      const std::shared_ptr<Transport::AcceptCallback>& onAccept,
      int failures) {
    TORCH_INTERNAL_ASSERT_DEBUG_ONLY(connectionContext_->executor->inThread());
    std::string url;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (closed_) {
        return;
      }
      url = address_;
    }
    if (listener_) {
      listener_->close();
    }
    // The old socket closes asynchronously; a bind that still finds the
    // port busy fails through the accept callback and comes back here.
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::min(failures, 10) * 10));
    try {
      listener_ = listenFromLoop(url);
      armAccept(listener_, onAccept, failures);
    } catch (const std::exception& e) {
      TORCHRPC_LOG(kError) << "TensorPipeTransport " << options_.name
                           << " cannot listen again on " << url << ": "
                           << e.what();
    }
  }

  const TensorPipeTransportOptions options_;
  const std::shared_ptr<ConnectionContext> connectionContext_;
  std::shared_ptr<tp::Context> context_;
  bool shm_ = false;
  // Touched on the executor only.
  std::shared_ptr<tp::Listener> listener_;

  mutable std::mutex mutex_;
  bool listening_ = false;
  bool closed_ = false;
  std::string address_;
};

TensorPipeTransport::TensorPipeTransport(TensorPipeTransportOptions options)
    : impl_(std::make_shared<TensorPipeTransportImpl>(std::move(options))) {}

TensorPipeTransport::~TensorPipeTransport() {
  impl_->join();
}

std::string TensorPipeTransport::name() const {
  return "tensorpipe";
}

void TensorPipeTransport::listen(AcceptCallback onAccept) {
  impl_->listen(std::move(onAccept));
}

std::string TensorPipeTransport::address() const {
  return impl_->address();
}

std::shared_ptr<Connection> TensorPipeTransport::connect(
    const std::string& address) {
  return impl_->connect(address);
}

void TensorPipeTransport::close() {
  impl_->close();
}

TransportStats TensorPipeTransport::stats() const {
  return impl_->stats();
}

void TensorPipeTransport::join() {
  impl_->join();
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
