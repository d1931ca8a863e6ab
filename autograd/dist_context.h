#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "autograd/send_recv_functions.h"

namespace torchrpc {
namespace autograd {

// What one worker records of one distributed autograd context: the send and
// recv functions of the messages it sent and received in it, and the
// workers it exchanged them with (who must release the context too).
// Thread-safe.
class DistContext {
 public:
  explicit DistContext(int64_t id) : id_(id) {}

  int64_t id() const {
    return id_;
  }

  void addSend(std::shared_ptr<SendFunction> send);
  void addRecv(std::shared_ptr<RecvFunction> recv);
  void addPeer(int64_t worker);

  // By message id.
  std::map<int64_t, std::shared_ptr<SendFunction>> sends() const;
  std::map<int64_t, std::shared_ptr<RecvFunction>> recvs() const;
  std::set<int64_t> peers() const;

 private:
  const int64_t id_;
  mutable std::mutex mutex_;
  std::map<int64_t, std::shared_ptr<SendFunction>> sends_;
  std::map<int64_t, std::shared_ptr<RecvFunction>> recvs_;
  std::set<int64_t> peers_;
};

} // namespace autograd
} // namespace torchrpc
