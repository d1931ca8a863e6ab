#include "autograd/context.h"

namespace torchrpc {
namespace autograd {

Context::Context(rpc::Runtime& runtime)
    : container_(ContextContainer::of(runtime)),
      context_(container_->open()),
      previous_(
          ContextContainer::exchangeCurrent(container_.get(), context_->id())) {
}

Context::~Context() {
  ContextContainer::exchangeCurrent(previous_.first, previous_.second);
  container_->release(context_->id());
}

} // namespace autograd
} // namespace torchrpc
