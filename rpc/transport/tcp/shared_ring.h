#pragma once

// A ring of small records in a sealed memfd, written by one process and
// read by another on the same host: the same-host path for small frames
// that passes no system call while its reader polls. No sockets and no
// threads: the bell is the caller's to ring, and the connection's use of
// it (tcp/connection.h) is in the Note below.

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
// reader only) and `reader` (the reader's state; both), then the maker's
// random u64 cookie. A record is {u32
// bytes | u32 zero | u64 tag} then its bytes, padded to 8; it may wrap
// around the end of the area.
//
// A connection's rings: once shared memory is negotiated both ways (Note
// [TCP same-host shared memory] in tcp/shared_segments.h: each side maps
// the other's memfds), a side whose transport polls (Note [Polling after
// traffic] in tcp/polling.h; asleep, every message would ring) makes a
// ring it reads and sends kRingOffer {u64 fd | u64 cookie} on the socket.
// The peer maps it through /proc/<pid>/fd (tcp/memfd.h's checks, and the
// cookie in its header must match; a refusal fails the connection), and
// the ring's bytes count against the maker's sharedMemoryMaxBytes. From
// then on the peer writes each kData frame of up to a quarter
// of the ring (none with tensors by address or in segments: their acks
// and checks are the socket's) into it as one record, or by socket when
// it does not fit. Heartbeats, acks and kClose stay on the socket.
//
// Order: a record's tag is the number of frames its writer had queued on
// the socket before it, all frames since the connection began. The reader
// counts the frames whose header it reads off the socket, and at each
// frame's start, before taking a byte of the socket's next frame, reads
// the record whose tag is that count, if it is there. A record is
// published before any frame queued after it is written, so it is there
// when that frame's bytes are: the frames of both paths are delivered in
// the order they were sent. A record with a smaller tag, one that does
// not hold whole frames, a frame in it that is not kData, or one larger
// than a quarter of the ring fails the connection (kMalformedMessage).
// When the socket ends, the records due before its end are read first.
//
// The bell: the reader says it polls (`reader` = kPolling) or is about to
// sleep (kAsleep); which, is its transport's (Note [Rings while the loop
// polls] in tcp/ring_watch.h). After publishing, a writer that finds
// kAsleep swaps it for kBelled and queues kRingBell (an empty frame) on
// the socket, which wakes the thread asleep in the reader's loop; later
// records ring no more until the reader polls again. A reader that goes
// to sleep stores kAsleep, then (after a full fence, as the writer fences
// between publishing and reading `reader`) checks for records again:
// either it sees the record or the writer sees kAsleep, never neither
// (the Dekker pattern).
//
// Trust: the peer can write any bytes into the whole mapping at any time.
// Each side keeps its own index private and only publishes it, so the
// peer's writes move nothing but what the other index claims: a writer
// refuses a `head` more than the area's size behind its tail or ahead of
// it, a reader a `tail` more than the area's size ahead of its head, a
// record longer than a record may be or longer than what was published.
// A record's bytes are copied out before anyone parses them (the frames
// in it then get every check of Note [TCP transport wire format]), so a
// peer that changes them afterwards changes nothing we use. A refusal is
// a value naming the cause; the connection then fails as for a bad frame.
// The memfd is sealed against shrinking and checked before it is mapped
// (tcp/memfd.h), so no access faults. A peer that can map our memfds can
// read and write our memory anyway (the rights of Note [TCP same-host
// zero copy]), so a ring adds no exposure.

constexpr size_t kRingHeaderBytes = 4096;
constexpr size_t kRingRecordHeaderBytes = 16;
constexpr size_t kRingMinCapacity = 4096;

// The bytes of the memfd of a ring whose data area is `capacity` bytes.
inline size_t ringBytesFor(size_t capacity) {
  return kRingHeaderBytes + capacity;
}

// A ring's memory: made here (the peer maps it through fd()), or the
// peer's, mapped after checks. Either side may make it; a connection's
// reader does, since whether a ring helps depends on whether it polls.
class SharedRingMemory {
 public:
  // A new ring of `capacity` data bytes (a power of two, at least
  // kRingMinCapacity; else throws c10::Error) whose header carries
  // `cookie`, or null with why (errno text) when the memfd cannot be made.
  static std::unique_ptr<SharedRingMemory> create(
      size_t capacity,
      uint64_t cookie,
      std::string& why);
  // Maps descriptor `fd` of process `peerPid` after tcp/memfd.h's checks,
  // refusing a data area that is not a power of two from kRingMinCapacity
  // to maxCapacity bytes. Null and why if refused.
  static std::unique_ptr<SharedRingMemory> mapPeer(
      pid_t peerPid,
      int fd,
      size_t maxCapacity,
      std::string& why);
  // The same for a descriptor of this process (`fd` stays open).
  static std::unique_ptr<SharedRingMemory> mapOwn(
      int fd,
      size_t maxCapacity,
      std::string& why);
  ~SharedRingMemory();
  SharedRingMemory(const SharedRingMemory&) = delete;
  SharedRingMemory& operator=(const SharedRingMemory&) = delete;

  // The memfd the peer maps (-1 for a mapping of the peer's).
  int fd() const {
    return own_.fd;
  }
  size_t capacity() const {
    return capacity_;
  }
  void* base() const {
    return base_;
  }
  // What the maker wrote into the header: a mapper compares it with what
  // the maker announced, so that a descriptor number reused meanwhile
  // (the maker's connection gone) maps nothing by mistake.
  uint64_t cookie() const;

 private:
  SharedRingMemory(OwnMemfd own, void* base, size_t bytes);
  // The memory of a mapping, or null and why: `refusal`, or a data area
  // that is not a power of two (then unmapped).
  static std::unique_ptr<SharedRingMemory> fromMapping(
      std::string refusal,
      void* base,
      size_t bytes,
      std::string& why);

  OwnMemfd own_; // fd -1 when mapped from the peer
  void* const base_;
  const size_t bytes_;
  const size_t capacity_;
};

// One piece of a record that push() gathers.
struct RingPiece {
  const void* data;
  size_t length;
};

// The writer's side. push() on one thread at a time.
class SharedRingWriter {
 public:
  explicit SharedRingWriter(std::unique_ptr<SharedRingMemory> memory);

  size_t capacity() const {
    return memory_->capacity();
  }
  // The longest record: one that fills the area alone.
  size_t maxRecordBytes() const {
    return capacity() - kRingRecordHeaderBytes;
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
  // One record of the `count` pieces, back to back.
  Push push(const RingPiece* pieces, size_t count, uint64_t tag);
  Push push(const void* bytes, size_t length, uint64_t tag) {
    const RingPiece piece{bytes, length};
    return push(&piece, 1, tag);
  }
  // Why the last push returned kCorrupt.
  const std::string& why() const {
    return why_;
  }
  // Bytes published and not yet consumed (for tests and stats).
  size_t pendingBytes() const;

 private:
  const std::unique_ptr<SharedRingMemory> memory_;
  char* const data_;
  uint64_t tail_ = 0; // ours; published to the header
  std::string why_;
};

// The reader's side. peek() and take() on one thread at a time; the
// bell's calls and hasRecords() on any thread.
class SharedRingReader {
 public:
  explicit SharedRingReader(std::unique_ptr<SharedRingMemory> memory);

  size_t capacity() const {
    return memory_->capacity();
  }
  size_t maxRecordBytes() const {
    return capacity() - kRingRecordHeaderBytes;
  }

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

  // Whether the writer published past what we consumed, and the position
  // it published to (a hint: the peer can write both words).
  bool hasRecords(uint64_t& tail) const;

  // The bell (Note [Shared rings for small frames]). polling(): the
  // writer need not ring. goingToSleep(): true if the reader may sleep
  // now, false if records arrived meanwhile (it stays marked asleep until
  // polling() is called again, so read them first).
  void polling();
  bool goingToSleep();

 private:
  const std::unique_ptr<SharedRingMemory> memory_;
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
