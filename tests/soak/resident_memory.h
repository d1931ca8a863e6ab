#pragma once

// This process's resident set size (VmRSS in /proc/self/status), in KiB;
// -1 if it cannot be read. And the bytes malloc has handed out and not got
// back (glibc's mallinfo2: in use in the main arena and the others, plus
// mmapped blocks): when RSS grows while this stays flat, the growth is the
// allocator's (fragmentation, arenas), not memory something still holds.
//
// Under AddressSanitizer, RSS is not the process's memory: freed blocks wait
// in ASan's quarantine (256 MiB by default) before they are reused, so RSS
// climbs for as long as a run lasts. There the bounded measure is the heap
// in use as ASan's allocator counts it (what the program allocated and has
// not freed), which a leak or an unbounded table would still grow.

#include <malloc.h>

#if defined(__SANITIZE_ADDRESS__)
#define TORCHRPC_SOAK_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TORCHRPC_SOAK_ASAN 1
#endif
#endif
#ifdef TORCHRPC_SOAK_ASAN
// The sanitizers' allocator interface (clang's sanitizer/allocator_interface.h;
// GCC ships the runtime but not that header).
extern "C" size_t __sanitizer_get_current_allocated_bytes();
#endif

#include <cstddef>
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
#ifdef TORCHRPC_SOAK_ASAN
  return static_cast<int64_t>(__sanitizer_get_current_allocated_bytes() / 1024);
#else
  struct mallinfo2 info = ::mallinfo2();
  return static_cast<int64_t>((info.uordblks + info.hblkhd) / 1024);
#endif
}

// What the soak bounds: RSS, or under ASan the heap in use (see above).
inline const char* boundedMemoryName() {
#ifdef TORCHRPC_SOAK_ASAN
  return "heap in use (ASan build: RSS counts its quarantine)";
#else
  return "rss";
#endif
}

inline int64_t boundedMemoryKiB() {
#ifdef TORCHRPC_SOAK_ASAN
  return heapInUseKiB();
#else
  return residentKiB();
#endif
}

} // namespace soak
} // namespace torchrpc
