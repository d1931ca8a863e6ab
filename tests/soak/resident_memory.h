#pragma once

// This process's resident set size (VmRSS in /proc/self/status), in KiB;
// -1 if it cannot be read.

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

} // namespace soak
} // namespace torchrpc
