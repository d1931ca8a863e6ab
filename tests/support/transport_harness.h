#pragma once

// Harness for tests of Transport implementations (rpc/transport/transport.h):
// waits with timeouts on what connections receive, accept and complete.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace harness {

using namespace std::chrono_literals;

constexpr std::chrono::milliseconds kTimeout = 10s;

// What one started connection has seen, for waits with a timeout.
class Inbox {
 public:
  void onMessage(Message&& message) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!errors_.empty()) {
      messageAfterError_ = true;
    }
    messages_.push_back(std::move(message));
    cv_.notify_all();
  }

  void onError(const TransportError& error) {
    std::lock_guard<std::mutex> lock(mutex_);
    errors_.push_back(error);
    cv_.notify_all();
  }

  bool waitForMessages(size_t count, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, timeout, [&]() {
      return messages_.size() >= count;
    });
  }

  bool waitForError(std::chrono::milliseconds timeout = kTimeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, timeout, [&]() { return !errors_.empty(); });
  }

  std::vector<Message> messages() {
    std::lock_guard<std::mutex> lock(mutex_);
    return messages_;
  }
  std::vector<TransportError> errors() {
    std::lock_guard<std::mutex> lock(mutex_);
    return errors_;
  }
  // Drops the inbox's references to the tensors received so far (their
  // messages still count).
  void releaseTensors() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Message& message : messages_) {
      message.tensors.clear();
    }
  }
  bool messageAfterError() {
    std::lock_guard<std::mutex> lock(mutex_);
    return messageAfterError_;
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Message> messages_;
  std::vector<TransportError> errors_;
  bool messageAfterError_ = false;
};

inline std::shared_ptr<Inbox> startWithInbox(
    const std::shared_ptr<Connection>& c) {
  auto inbox = std::make_shared<Inbox>();
  c->start(
      [inbox](Message&& message) { inbox->onMessage(std::move(message)); },
      [inbox](const TransportError& error) { inbox->onError(error); });
  return inbox;
}

// Listens on a transport and keeps what it accepts.
class Acceptor {
 public:
  explicit Acceptor(Transport& transport) {
    transport.listen([this](std::shared_ptr<Connection> connection) {
      auto inbox = startWithInbox(connection);
      std::lock_guard<std::mutex> lock(mutex_);
      accepted_.push_back({std::move(connection), std::move(inbox)});
      cv_.notify_all();
    });
  }

  struct Accepted {
    std::shared_ptr<Connection> connection;
    std::shared_ptr<Inbox> inbox;
  };

  // The index-th accepted connection, or nullptr connection on timeout.
  Accepted waitFor(size_t index, std::chrono::milliseconds timeout = kTimeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!cv_.wait_for(lock, timeout, [&]() {
          return accepted_.size() > index;
        })) {
      return Accepted{};
    }
    return accepted_[index];
  }

  size_t count() {
    std::lock_guard<std::mutex> lock(mutex_);
    return accepted_.size();
  }

  void forget() {
    std::lock_guard<std::mutex> lock(mutex_);
    accepted_.clear();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<Accepted> accepted_;
};

// Collects send completions; checks each runs exactly once.
class SendTracker {
 public:
  Connection::SendCallback callback() {
    auto slot = std::make_shared<std::atomic<int>>(0);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      slots_.push_back(slot);
    }
    return [this, slot](const TransportError* error) {
      slot->fetch_add(1);
      std::lock_guard<std::mutex> lock(mutex_);
      ++completed_;
      if (error != nullptr) {
        errors_.push_back(*error);
      }
      cv_.notify_all();
    };
  }

  bool waitAll(std::chrono::milliseconds timeout = kTimeout) {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, timeout, [&]() {
      return completed_ >= slots_.size();
    });
  }

  void expectEachRanOnce() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < slots_.size(); ++i) {
      ASSERT_EQ(slots_[i]->load(), 1) << "send #" << i;
    }
  }

  size_t errorCount() {
    std::lock_guard<std::mutex> lock(mutex_);
    return errors_.size();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::shared_ptr<std::atomic<int>>> slots_;
  size_t completed_ = 0;
  std::vector<TransportError> errors_;
};

inline void expectReceived(const at::Tensor& received, const at::Tensor& sent) {
  ASSERT_EQ(received.dim(), 1);
  EXPECT_EQ(received.scalar_type(), at::kByte);
  EXPECT_TRUE(received.device().is_cpu());
  EXPECT_EQ(received.storage_offset(), 0);
  ASSERT_EQ(static_cast<size_t>(received.numel()), sent.nbytes());
  EXPECT_EQ(received.storage().nbytes(), sent.nbytes());
  if (sent.nbytes() == 0) {
    return;
  }
  // Never the sender's memory.
  auto* begin = static_cast<const char*>(sent.data_ptr());
  auto* got = static_cast<const char*>(received.data_ptr());
  EXPECT_TRUE(got + sent.nbytes() <= begin || got >= begin + sent.nbytes());
  EXPECT_EQ(std::memcmp(got, begin, sent.nbytes()), 0);
}

inline Message makeMessage(
    std::string header,
    std::vector<at::Tensor> tensors = {}) {
  Message message;
  message.header = std::move(header);
  message.tensors = std::move(tensors);
  return message;
}

} // namespace harness
} // namespace rpc
} // namespace torchrpc
