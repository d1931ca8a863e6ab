#pragma once

// Marks the threads that run a handler where its request arrived (Note
// [Where messages are handled] in rpc/agent.cpp), so that a wait there
// fails at once instead of stalling the connection it waits on.

namespace torchrpc {
namespace rpc {
namespace detail {

// The current thread runs an inline handler while one of these lives.
class InlineHandlerScope {
 public:
  InlineHandlerScope();
  ~InlineHandlerScope();
  InlineHandlerScope(const InlineHandlerScope&) = delete;
  InlineHandlerScope& operator=(const InlineHandlerScope&) = delete;

 private:
  bool previous_;
};

bool runningInlineHandler() noexcept;

} // namespace detail
} // namespace rpc
} // namespace torchrpc
