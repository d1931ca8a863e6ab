#include "torchrpc/rpc/log_level.h"

#include <cctype>
#include <cstdlib>
#include <string>

namespace torchrpc {
namespace rpc {
bool parseLogLevel(const char* text, LogLevel* level) {
  if (text == nullptr) {
    return false;
  }
  std::string name;
  for (const char* c = text; *c != '\0'; ++c) {
    name += static_cast<char>(std::tolower(static_cast<unsigned char>(*c)));
  }
  if (name == "debug") {
    *level = LogLevel::kDebug;
  } else if (name == "info") {
    *level = LogLevel::kInfo;
  } else if (name == "warning") {
    *level = LogLevel::kWarning;
  } else if (name == "error") {
    *level = LogLevel::kError;
  } else {
    return false;
  }
  return true;
}

LogLevel logLevel() {
  // Function-local: initialised once, thread-safely, on first use.
  static const LogLevel level = []() {
    LogLevel chosen = LogLevel::kWarning;
    const char* text = std::getenv("TORCHRPC_LOG_LEVEL");
    if (text != nullptr && *text != '\0' && !parseLogLevel(text, &chosen)) {
      LOG(WARNING) << "TORCHRPC_LOG_LEVEL is '" << text
                   << "', not one of debug, info, warning, error; using "
                      "warning";
      chosen = LogLevel::kWarning;
    }
    return chosen;
  }();
  return level;
}

} // namespace rpc
} // namespace torchrpc
