#include "torchrpc/rpc/detail/logging.h"

#include <c10/util/Logging.h>

#include <cstdlib>
#include <mutex>

namespace torchrpc {
namespace rpc {
namespace detail {

void initLoggingOnce() {
#ifdef C10_USE_GLOG
  // Not c10::InitCaffeLogging(): it also installs glog's failure signal
  // handler (SIGSEGV, SIGTERM, ...), replacing the application's handlers and
  // printing a stack dump whenever a launcher stops a worker.
  static std::once_flag once;
  std::call_once(once, []() {
    if (google::IsGoogleLoggingInitialized()) {
      return; // the application's configuration stands
    }
    // Before initialisation glog writes every message to stderr; after it,
    // by default to files under /tmp. Keep them where users saw them.
    if (std::getenv("GLOG_logtostderr") == nullptr &&
        std::getenv("GLOG_log_dir") == nullptr) {
      FLAGS_logtostderr = true;
    }
    google::InitGoogleLogging("torchrpc");
  });
#endif
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
