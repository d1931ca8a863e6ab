#pragma once

#include <string>

namespace torchrpc {
namespace launcher {

// Relays one output stream of one worker: each complete line goes to
// `outFd` as "[rank N]: line\n" in a single write(), so that lines of
// different workers never mix mid-line; the raw bytes go to a log file as
// well when one is open. Not thread-safe: the launcher's one loop owns it.
class OutputRelay {
 public:
  // Opens (creates, truncates) `logPath` unless it is empty; throws
  // std::runtime_error when it cannot.
  OutputRelay(int rank, int outFd, const std::string& logPath);
  ~OutputRelay();
  OutputRelay(const OutputRelay&) = delete;
  OutputRelay& operator=(const OutputRelay&) = delete;

  void feed(const char* data, size_t size);
  // Emits a last line that had no newline, and closes the log file.
  void finish();

 private:
  void emit(const std::string& line);

  std::string prefix_;
  int outFd_;
  int logFd_ = -1;
  std::string pending_;
};

// write() all of it, retrying after EINTR and short writes; gives up
// silently when the reader is gone (EPIPE).
void writeAll(int fd, const char* data, size_t size);

} // namespace launcher
} // namespace torchrpc
