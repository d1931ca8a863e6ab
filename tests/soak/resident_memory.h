#pragma once

// This process's resident set size (VmRSS in /proc/self/status), in KiB;
// -1 if it cannot be read. And the bytes malloc has handed out and not got
// back (glibc's mallinfo2: in use in the main arena and the others, plus
// mmapped blocks): when RSS grows while this stays flat, the growth is the
// allocator's (fragmentation, arenas), not memory something still holds.

#include <malloc.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

namespace torchrpc {
namespace soak {

inline int64_t residentKiB() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      std::istringstream fields(line.substr(6));
      int64_t kib = -1;
      fields >> kib;
      return kib;
    }
  }
  return -1;
}

inline int64_t heapInUseKiB() {
  struct mallinfo2 info = ::mallinfo2();
  return static_cast<int64_t>((info.uordblks + info.hblkhd) / 1024);
}

} // namespace soak
} // namespace torchrpc
