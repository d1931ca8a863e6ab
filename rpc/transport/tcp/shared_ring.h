#pragma once

// A ring of small records in a sealed memfd, written by one process and
// read by another on the same host: the same-host path for small frames
// that passes no system call while its reader polls. No sockets and no
// threads: the bell is the caller's to ring.

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "torchrpc/rpc/transport/tcp/memfd.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

// Note [Shared rings for small frames]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Why: on the machine of bench/RESULTS.md a system call costs about a
// microsecond, and a round trip over a local socket (two sendmsg, two
// reads, epoll) is 9-12 µs more than the same exchange through one shared
// page that both sides poll ("The round trip without the kernel" and "A
// kernel six to nine times dearer" there). A ring lets a sender hand a
// small frame to a polling reader with a memcpy and a store.
//
// Layout: one header page, then a data area of a power of two bytes. The
// header holds three words, each on its own cache line: `tail` (bytes
// published; written by the writer only), `head` (bytes consumed; the
// reader only) and `reader` (the reader's state; both). A record is {u32
// bytes | u32 zero | u64 tag} then its bytes, padded to 8; it may wrap
// around the end of the area. The tag is the caller's (a connection
// would put there how many frames it sent by socket before this one, so
// that its reader keeps one order over both paths).
//
// The bell: the reader says it polls (`reader` = kPolling) or is about to
// sleep (kAsleep). After publishing, a writer that finds kAsleep swaps it
// for kBelled and tells its caller to ring the bell (a byte on the
// connection's socket, say), so a sleeping reader is woken once however
// many records follow. A reader that goes to sleep stores kAsleep, then
// (after a full fence, as the writer fences between publishing and
// reading `reader`) checks for records again: either it sees the record
// or the writer sees kAsleep, never neither (the Dekker pattern).
//
// Trust: the peer can write any bytes into the whole mapping at any time.
// Each side keeps its own index private and only publishes it, so the
// peer's writes move nothing but what the other index claims: a writer
// refuses a `head` more than the area's size behind its tail or ahead of
// it, a reader a `tail` more than the area's size ahead of its head, a
// record longer than a record may be or longer than what was published.
// A record's bytes are copied out before anyone parses them, so a peer
// that changes them afterwards changes nothing we use. A refusal is a
// value naming the cause; the connection then fails as for a bad frame.
// The memfd is sealed against shrinking and checked before it is mapped
// (tcp/memfd.h), so no access faults.

constexpr size_t kRingHeaderBytes = 4096;
constexpr size_t kRingRecordHeaderBytes = 16;

// The bytes of the memfd of a ring whose data area is `capacity` bytes.
inline size_t ringBytesFor(size_t capacity) {
  return kRingHeaderBytes + capacity;
}

// The writer's side: makes the ring. One thread at a time.
class SharedRingWriter {
 public:
  // A ring of `capacity` data bytes (a power of two, at least 4096; else
  // throws c10::Error), or null with why (errno text) when the memfd
  // cannot be made.
  static std::unique_ptr<SharedRingWriter> create(
      size_t capacity,
      std::string& why);
  ~SharedRingWriter();
  SharedRingWriter(const SharedRingWriter&) = delete;
  SharedRingWriter& operator=(const SharedRingWriter&) = delete;

  // The memfd the reader maps (open for the writer's lifetime).
  int fd() const {
    return memfd_.fd;
  }
  size_t capacity() const {
    return capacity_;
  }
  // The longest record: one that fills the area alone.
  size_t maxRecordBytes() const {
    return capacity_ - kRingRecordHeaderBytes;
  }

  enum class Push {
    kPushed, // published; the reader polls (or was belled already)
    kPushedRingBell, // published; the reader sleeps: wake it
    kFull, // not published: no room until the reader consumes
    kTooLarge, // not published: longer than maxRecordBytes()
    // Not published: the reader's index is impossible (why()); the ring
    // is unusable from then on.
    kCorrupt,
  };
  Push push(const void* bytes, size_t length, uint64_t tag);
  // Why the last push returned kCorrupt.
  const std::string& why() const {
    return why_;
  }
  // Bytes published and not yet consumed (for tests and stats).
  size_t pendingBytes() const;

 private:
  SharedRingWriter(OwnMemfd memfd, size_t capacity);

  OwnMemfd memfd_;
  const size_t capacity_;
  char* const data_;
  uint64_t tail_ = 0; // ours; published to the header
  std::string why_;
};

// The reader's side: maps the writer's ring. One thread at a time.
class SharedRingReader {
 public:
  // Maps descriptor `fd` of process `peerPid` after tcp/memfd.h's checks,
  // refusing a data area that is not a power of two from 4096 to
  // maxCapacity bytes. Null and why if refused.
  static std::unique_ptr<SharedRingReader> mapPeer(
      pid_t peerPid,
      int fd,
      size_t maxCapacity,
      std::string& why);
  // The same for a descriptor of this process (`fd` stays open).
  static std::unique_ptr<SharedRingReader> mapOwn(
      int fd,
      size_t maxCapacity,
      std::string& why);
  ~SharedRingReader();
  SharedRingReader(const SharedRingReader&) = delete;
  SharedRingReader& operator=(const SharedRingReader&) = delete;

  enum class Read { kEmpty, kRecord, kCorrupt };
  // The oldest record: its tag and length (no more than maxRecordBytes(),
  // checked), left in the ring. kCorrupt says why() (the ring is then
  // unusable).
  Read peek(uint64_t& tag, size_t& length);
  // Copies the record peek() found into `out` (its length bytes) and
  // consumes it. Only after peek() returned kRecord.
  void take(void* out);
  const std::string& why() const {
    return why_;
  }
  size_t maxRecordBytes() const {
    return capacity_ - kRingRecordHeaderBytes;
  }

  // The bell (Note [Shared rings for small frames]). polling(): the
  // writer need not ring. goingToSleep(): true if the reader may sleep
  // now, false if records arrived meanwhile (it stays marked asleep until
  // polling() is called again, so read them first).
  void polling();
  bool goingToSleep();

 private:
  SharedRingReader(void* base, size_t bytes);
  // The reader of a mapping, or null and why: `refusal`, or a data area
  // that is not a power of two (then unmapped).
  static std::unique_ptr<SharedRingReader> fromMapping(
      std::string refusal,
      void* base,
      size_t bytes,
      std::string& why);

  void* const base_;
  const size_t bytes_;
  const size_t capacity_;
  const char* const data_;
  uint64_t head_ = 0; // ours; published to the header
  // What peek() found, for take().
  size_t peekedLength_ = 0;
  bool peeked_ = false;
  std::string why_;
};

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
