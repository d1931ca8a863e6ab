#pragma once

// Sealed memfds shared between two processes of one host: made and mapped
// by their owner, and mapped by a peer only after checks that make every
// access through the mapping safe; and the budget their bytes count
// against. Serves the shared segments of large tensors
// (tcp/shared_segments.h) and the rings of small frames (tcp/shared_ring.h).

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

// A memfd of `bytes` sealed against shrinking, growing and further seals,
// mapped read-write and shared. Fails with errno set and fd -1.
struct OwnMemfd {
  int fd = -1;
  void* base = nullptr;
  size_t bytes = 0;
};
OwnMemfd createSealedMemfd(const char* name, size_t bytes);
// Unmaps and closes; a peer's mapping keeps the memory until it unmaps.
void destroyMemfd(OwnMemfd& memfd);

// Bytes of shared memory counted in a transport's budget (its segments and
// rings together: sharedMemoryMaxBytes) for as long as this lives.
class SharedMemoryCharge {
 public:
  SharedMemoryCharge() = default;
  // `bytes` charged to `charged` if the total stays within `maxBytes`;
  // else a charge that holds nothing.
  static SharedMemoryCharge tryCharge(
      std::shared_ptr<std::atomic<size_t>> charged,
      size_t bytes,
      size_t maxBytes);
  SharedMemoryCharge(SharedMemoryCharge&& other) noexcept;
  SharedMemoryCharge& operator=(SharedMemoryCharge&& other) noexcept;
  ~SharedMemoryCharge();

  bool held() const {
    return bytes_ > 0;
  }

 private:
  std::shared_ptr<std::atomic<size_t>> charged_;
  size_t bytes_ = 0;
};

// What a peer's memfd must be before we map it. `what` names it in
// refusals ("shared segment": "shared segment is too small").
struct PeerMemfdLimits {
  const char* what = "";
  size_t minBytes = 0;
  size_t maxBytes = 0;
  // The refusal of one larger than maxBytes (its reason is the caller's).
  const char* tooLarge = "";
};

// Opens descriptor `fd` of process `peerPid` (/proc/<pid>/fd/<fd>, which
// needs the rights process_vm_readv needs) and maps it read-write shared
// if it is a memfd on tmpfs (not hugetlbfs, whose pages may run out),
// sealed against shrinking (no access through the mapping can fault), of
// minBytes to maxBytes. Empty string and the mapping in base and bytes,
// or why not (errno text included).
std::string mapPeerMemfd(
    pid_t peerPid,
    int fd,
    const PeerMemfdLimits& limits,
    void*& base,
    size_t& bytes);

// The same checks and mapping for a descriptor of this process (one
// inherited over fork(), or in tests); `fd` stays open.
std::string mapCheckedMemfd(
    int fd,
    const PeerMemfdLimits& limits,
    void*& base,
    size_t& bytes);

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
