#include "autograd/dist_context.h"

namespace torchrpc {
namespace autograd {

void DistContext::addSend(std::shared_ptr<SendFunction> send) {
  std::lock_guard<std::mutex> guard(mutex_);
  peers_.insert(send->toWorker());
  sends_.emplace(send->messageId(), std::move(send));
}

void DistContext::addRecv(std::shared_ptr<RecvFunction> recv) {
  std::lock_guard<std::mutex> guard(mutex_);
  peers_.insert(recv->fromWorker());
  recvs_.emplace(recv->messageId(), std::move(recv));
}

void DistContext::addPeer(int64_t worker) {
  std::lock_guard<std::mutex> guard(mutex_);
  peers_.insert(worker);
}

std::map<int64_t, std::shared_ptr<SendFunction>> DistContext::sends() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return sends_;
}

std::map<int64_t, std::shared_ptr<RecvFunction>> DistContext::recvs() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return recvs_;
}

std::set<int64_t> DistContext::peers() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return peers_;
}

} // namespace autograd
} // namespace torchrpc
