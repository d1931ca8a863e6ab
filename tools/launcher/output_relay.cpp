#include "output_relay.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace torchrpc {
namespace launcher {

void writeAll(int fd, const char* data, size_t size) {
  while (size > 0) {
    ssize_t written = ::write(fd, data, size);
    if (written < 0) {
      if (errno == EINTR) {
        continue;
      }
      return;
    }
    data += written;
    size -= static_cast<size_t>(written);
  }
}

OutputRelay::OutputRelay(int rank, int outFd, const std::string& logPath)
    : prefix_("[rank " + std::to_string(rank) + "]: "),
      outFd_(outFd) {
  if (!logPath.empty()) {
    logFd_ =
        ::open(logPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (logFd_ < 0) {
      throw std::runtime_error(
          "cannot open log file " + logPath + ": " + std::strerror(errno));
    }
  }
}

OutputRelay::~OutputRelay() {
  if (logFd_ >= 0) {
    ::close(logFd_);
  }
}

void OutputRelay::feed(const char* data, size_t size) {
  if (logFd_ >= 0) {
    writeAll(logFd_, data, size);
  }
  pending_.append(data, size);
  size_t start = 0;
  for (size_t newline = pending_.find('\n'); newline != std::string::npos;
       newline = pending_.find('\n', start)) {
    emit(pending_.substr(start, newline - start));
    start = newline + 1;
  }
  pending_.erase(0, start);
}

void OutputRelay::finish() {
  if (!pending_.empty()) {
    emit(pending_);
    pending_.clear();
  }
  if (logFd_ >= 0) {
    ::close(logFd_);
    logFd_ = -1;
  }
}

void OutputRelay::emit(const std::string& line) {
  std::string out = prefix_ + line + "\n";
  writeAll(outFd_, out.data(), out.size());
}

} // namespace launcher
} // namespace torchrpc
