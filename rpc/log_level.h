#pragma once

// torchrpc's log lines and their levels (Note [Log levels]).

#include <c10/util/Logging.h>

namespace torchrpc {
namespace rpc {
// Note [Log levels]
// ~~~~~~~~~~~~~~~~~
// torchrpc logs through libtorch's logging (glog), so its lines land where
// libtorch's do. How much it says is TORCHRPC_LOG_LEVEL's:
//   error    only failures that end something;
//   warning  (the default) also what a user should act on: lost workers,
//            timed-out calls, peers that misbehave;
//   info     also the job's life: where metrics are served, where a trace
//            was written;
//   debug    also one line per event: connections opened and failed,
//            cancels received, requests and responses dropped, contexts
//            released, RRef deletions.
// Every line names the worker, and the ids the event concerns (message,
// context, fork). The variable is read once per process (logging is
// per process); an unknown value is reported once, naming it, and the
// default kept. A line below the level costs a relaxed load: nothing of it
// is formatted.
enum class LogLevel : int { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3 };

// The level TORCHRPC_LOG_LEVEL chose.
LogLevel logLevel();

// Parses a level's name ("debug", "info", "warning", "error", any case);
// false for anything else.
bool parseLogLevel(const char* text, LogLevel* level);

inline bool logs(LogLevel level) {
  return static_cast<int>(level) >= static_cast<int>(logLevel());
}

} // namespace rpc
} // namespace torchrpc

// TORCHRPC_LOG(kDebug) << worker << ": ...";
#define TORCHRPC_LOG(level)                                       \
  if (!::torchrpc::rpc::logs(::torchrpc::rpc::LogLevel::level)) { \
  } else                                                          \
    TORCHRPC_LOG_STREAM_##level
#define TORCHRPC_LOG_STREAM_kDebug LOG(INFO) << "[torchrpc debug] "
#define TORCHRPC_LOG_STREAM_kInfo LOG(INFO) << "[torchrpc] "
#define TORCHRPC_LOG_STREAM_kWarning LOG(WARNING)
#define TORCHRPC_LOG_STREAM_kError LOG(ERROR)
