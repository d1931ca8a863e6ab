#pragma once

// Same-host shared memory of the TCP transport: the segments a sender
// copies large tensors into, and the receiver's mappings of a peer's
// segments, which become the received tensors' storage. No sockets and no
// threads: a connection owns one of each and calls them.

#include <ATen/core/Tensor.h>

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "torchrpc/rpc/transport/tcp/parallel_copier.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

// Note [TCP same-host shared memory]
//
// Why: a tensor read with process_vm_readv (Note [TCP same-host zero copy])
// moves at 5.5-7 GB/s here, bound by the kernel pinning the peer's pages,
// while a warm memcpy moves 17-20 GB/s. So when both sides allow it, a
// large tensor is instead copied once by its sender into a shared memory
// segment the receiver has mapped already, and the receiver's tensor is a
// view of that mapping: the receiver copies nothing.
//
// A segment is a sealed memfd (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)
// of one page of header and a data area. The header's first u32 is the
// in-use flag: the sender sets it before it copies a tensor in, and the
// receiver clears it when the storage of the tensor it made of the segment
// dies. A sender reuses a segment whose flag is clear, so after the first
// calls the segments are warm and a call costs one memcpy into them (on
// two cores from 1 MiB: Note [Copies into shared memory on two cores] in
// tcp/parallel_copier.h). Each sender keeps at most sharedMemoryMaxBytes
// of segments per transport; when none is free and no more fit, a tensor
// goes by address as before.
//
// Negotiation: kCmaProbe's and kCmaResult's flag byte has a second bit,
// "send me shared segments", set only with the first ("I can read you"),
// since mapping a peer's memfd through /proc/<pid>/fd needs the same
// rights as reading its memory. A sender uses kDataShared only to a peer
// that set it:
//
//   kDataShared = kData's header and lengths | u64 id |
//                 per tensor {u64 segment | u64 word} | body | inline bytes
//
// segment 0: `word` is an address, as in kDataCma (0: the bytes follow
// inline). Otherwise the tensor's bytes are at offset kSegmentDataOffset of
// segment `segment` (ids start at 1 and are never reused by a connection),
// and `word` is the sender's fd of that segment, which a receiver that has
// not mapped the segment opens as /proc/<pid>/fd/<word>. The receiver acks
// `id` only when some tensor came by address.
//
// What a receiver checks before it maps: the fd is a memfd on tmpfs (not
// hugetlbfs, whose pages may run out) sealed against shrinking, so no
// access through the mapping can fault (SIGBUS); it is no larger than a
// segment for the largest tensor the connection accepts; the tensor lies
// within it; and the segment is not one it still holds, so a peer that
// reuses a segment too early fails the connection instead of changing a
// tensor we were given. What it cannot check: that the sender leaves the
// bytes alone afterwards. A process that can map our segments can read and
// write our memory anyway (the same ptrace rights), so that adds no
// exposure.
//
// A receiver keeps its mappings for reuse (at most kMaxIdleMappings not
// held by a tensor per connection, and none of a segment whose sender
// retired it: the header's second u32, set when a sender frees a segment
// to make room in its budget); a tensor keeps its mapping alive after the
// connection and the sender are gone.

constexpr size_t kSegmentDataOffset = 4096;

// The bytes of a segment (header page included) that holds a tensor of
// `nbytes`: what a sender makes, and what a receiver expects at most.
size_t segmentBytesFor(size_t nbytes);

// What a frame says of a tensor that travels in a segment.
struct SegmentPlacement {
  uint64_t segment = 0;
  int fd = -1; // the sender's
};

// The sender's side: segments of one connection, created on demand and
// reused once the receiver is done with them. Thread-safe.
class SegmentSender {
 public:
  // `chargedBytes` is shared by all senders of a transport and bounds the
  // bytes of their segments together at `maxBytes`. `copier`, when given,
  // copies tensors in and outlives the sender; else a plain memcpy does.
  SegmentSender(
      std::shared_ptr<std::atomic<size_t>> chargedBytes,
      size_t maxBytes,
      ParallelCopier* copier = nullptr);
  ~SegmentSender();
  SegmentSender(const SegmentSender&) = delete;
  SegmentSender& operator=(const SegmentSender&) = delete;

  // Copies `tensor` (contiguous, CPU) into a free segment, marked in use,
  // and says which. Nothing when no segment is free and no new one fits the
  // budget, or one cannot be created: the caller sends the tensor
  // otherwise.
  std::optional<SegmentPlacement> copyIn(const at::Tensor& tensor);

  // For tests and stats.
  size_t segmentCount() const;
  size_t segmentBytes() const;

 private:
  struct Segment;
  // A free segment of at least `capacity` data bytes, marked in use, or
  // null; may free idle smaller segments to make room in the budget.
  Segment* acquireLocked(size_t capacity);
  void destroy(Segment& segment);

  const std::shared_ptr<std::atomic<size_t>> chargedBytes_;
  const size_t maxBytes_;
  ParallelCopier* const copier_;
  mutable std::mutex mutex_;
  uint64_t nextId_ = 1;
  std::vector<std::unique_ptr<Segment>> segments_;
};

// The receiver's side: the peer's segments it has mapped. One thread at a
// time (a connection's strand); the tensors it hands out may die anywhere.
class SegmentReceiver {
 public:
  // Segments larger than one for a tensor of maxTensorBytes are refused.
  explicit SegmentReceiver(size_t maxTensorBytes);
  ~SegmentReceiver();
  SegmentReceiver(const SegmentReceiver&) = delete;
  SegmentReceiver& operator=(const SegmentReceiver&) = delete;

  // A 1-D kByte tensor of `length` bytes viewing segment `placement` of
  // process `peerPid`, mapped now if it was not; held until its storage
  // dies. Empty string and the tensor in `out`, or why the peer's frame is
  // refused (errno text included).
  std::string view(
      pid_t peerPid,
      const SegmentPlacement& placement,
      uint64_t length,
      at::Tensor& out);

  size_t mappedCount() const {
    return mapped_.size();
  }

 private:
  struct Mapping;
  void evictIdle();

  const size_t maxSegmentBytes_;
  std::map<uint64_t, std::shared_ptr<Mapping>> mapped_;
};

constexpr size_t kMaxIdleMappings = 16;

// Whether the storage of `tensor` lies in a segment mapping (tests).
bool viewsSharedSegment(const at::Tensor& tensor);

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
