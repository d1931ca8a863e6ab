#include "torchrpc/rpc/detail/inline_handler.h"

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {
thread_local bool inlineHandlerRunning = false;
} // namespace

InlineHandlerScope::InlineHandlerScope() : previous_(inlineHandlerRunning) {
  inlineHandlerRunning = true;
}

InlineHandlerScope::~InlineHandlerScope() {
  inlineHandlerRunning = previous_;
}

bool runningInlineHandler() noexcept {
  return inlineHandlerRunning;
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
