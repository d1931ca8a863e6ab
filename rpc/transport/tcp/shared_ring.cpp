#include "torchrpc/rpc/transport/tcp/shared_ring.h"

#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <utility>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

namespace {

// The reader's states (the header's `reader` word).
constexpr uint32_t kPolling = 0;
constexpr uint32_t kAsleep = 1;
constexpr uint32_t kBelled = 2;

// The header's words, each on its own cache line so that the writer's
// stores to `tail` do not evict the line the reader stores `head` to.
// Lock-free, so they work across processes mapping the same page.
static_assert(
    std::atomic<uint64_t>::is_always_lock_free &&
        std::atomic<uint32_t>::is_always_lock_free,
    "atomics shared between processes must be lock-free");

std::atomic<uint64_t>& tailWord(void* base) {
  return *reinterpret_cast<std::atomic<uint64_t>*>(base);
}
std::atomic<uint64_t>& headWord(void* base) {
  return *reinterpret_cast<std::atomic<uint64_t>*>(
      static_cast<char*>(base) + 64);
}
std::atomic<uint32_t>& readerWord(void* base) {
  return *reinterpret_cast<std::atomic<uint32_t>*>(
      static_cast<char*>(base) + 128);
}
// Written once by the maker, before the ring is announced.
constexpr size_t kCookieOffset = 192;

bool powerOfTwo(size_t n) {
  return n != 0 && (n & (n - 1)) == 0;
}

size_t padded(size_t length) {
  return kRingRecordHeaderBytes + ((length + 7) & ~size_t(7));
}

// Copies `length` bytes at ring position `at` (any u64) of a data area of
// `capacity` bytes, across its end if need be.
void copyOut(
    const char* data,
    size_t capacity,
    uint64_t at,
    void* to,
    size_t length) {
  if (length == 0) {
    return; // `to` may be null (an empty tensor's)
  }
  const size_t offset = static_cast<size_t>(at & (capacity - 1));
  const size_t first = std::min(length, capacity - offset);
  std::memcpy(to, data + offset, first);
  std::memcpy(static_cast<char*>(to) + first, data, length - first);
}

void copyIn(
    char* data,
    size_t capacity,
    uint64_t at,
    const void* from,
    size_t length) {
  if (length == 0) {
    return; // `from` may be null (an empty tensor's)
  }
  const size_t offset = static_cast<size_t>(at & (capacity - 1));
  const size_t first = std::min(length, capacity - offset);
  std::memcpy(data + offset, from, first);
  std::memcpy(data, static_cast<const char*>(from) + first, length - first);
}

} // namespace

// ---- Memory ----

namespace {

// Every page of a ring's mapping is made present now, on both sides, rather
// than at the first record that reaches it: in the first pass around a
// ring, the writer's copy of a record of 4 KiB into pages it had not
// touched took about 50 µs, against 0.3 µs once they were there, on the
// machine of bench/RESULTS.md ("A ring's first pass"); the first hundred or
// so such records of every connection paid it. Now the connection's start
// pays it once (tens of µs for 256 KiB). The memory counts in the maker's
// budget either way; a peer's ring is at most kMaxSharedRingBytes, and its
// maker can write our memory anyway (Note [Shared rings for small frames]).
// Best effort: a kernel before 5.14 has no MADV_POPULATE_WRITE (EINVAL), and
// the pages then come as they are touched, as before.
void mapPagesNow(void* base, size_t bytes) {
#ifdef MADV_POPULATE_WRITE
  (void)::madvise(base, bytes, MADV_POPULATE_WRITE);
#else
  (void)base;
  (void)bytes;
#endif
}

} // namespace

SharedRingMemory::SharedRingMemory(OwnMemfd own, void* base, size_t bytes)
    : own_(own),
      base_(base),
      bytes_(bytes),
      capacity_(bytes - kRingHeaderBytes) {
  mapPagesNow(base_, bytes_);
}

SharedRingMemory::~SharedRingMemory() {
  if (own_.fd >= 0) {
    destroyMemfd(own_);
  } else {
    ::munmap(base_, bytes_);
  }
}

std::unique_ptr<SharedRingMemory> SharedRingMemory::create(
    size_t capacity,
    uint64_t cookie,
    std::string& why) {
  TORCH_CHECK(
      powerOfTwo(capacity) && capacity >= kRingMinCapacity,
      "a shared ring's capacity must be a power of two of at least ",
      kRingMinCapacity,
      " bytes, not ",
      capacity);
  OwnMemfd memfd = createSealedMemfd("torchrpc-ring", ringBytesFor(capacity));
  if (memfd.fd < 0) {
    why = std::string("cannot make a shared ring: ") + std::strerror(errno);
    return nullptr;
  }
  // A new memfd reads as zeros: tail 0, head 0, the reader polling until
  // it says otherwise.
  std::memcpy(
      static_cast<char*>(memfd.base) + kCookieOffset,
      &cookie,
      sizeof(cookie));
  return std::unique_ptr<SharedRingMemory>(
      new SharedRingMemory(memfd, memfd.base, memfd.bytes));
}

uint64_t SharedRingMemory::cookie() const {
  uint64_t cookie = 0;
  std::memcpy(
      &cookie,
      static_cast<const char*>(base_) + kCookieOffset,
      sizeof(cookie));
  return cookie;
}

namespace {

PeerMemfdLimits ringLimits(size_t maxCapacity) {
  return PeerMemfdLimits{
      "shared ring",
      ringBytesFor(kRingMinCapacity),
      ringBytesFor(maxCapacity),
      "shared ring is larger than this connection accepts"};
}

} // namespace

std::unique_ptr<SharedRingMemory> SharedRingMemory::fromMapping(
    std::string refusal,
    void* base,
    size_t bytes,
    std::string& why) {
  if (refusal.empty() && !powerOfTwo(bytes - kRingHeaderBytes)) {
    ::munmap(base, bytes);
    refusal = "shared ring's data area is not a power of two";
  }
  if (!refusal.empty()) {
    why = std::move(refusal);
    return nullptr;
  }
  return std::unique_ptr<SharedRingMemory>(
      new SharedRingMemory(OwnMemfd(), base, bytes));
}

std::unique_ptr<SharedRingMemory> SharedRingMemory::mapPeer(
    pid_t peerPid,
    int fd,
    size_t maxCapacity,
    std::string& why) {
  void* base = nullptr;
  size_t bytes = 0;
  std::string refusal =
      mapPeerMemfd(peerPid, fd, ringLimits(maxCapacity), base, bytes);
  return fromMapping(std::move(refusal), base, bytes, why);
}

std::unique_ptr<SharedRingMemory> SharedRingMemory::mapOwn(
    int fd,
    size_t maxCapacity,
    std::string& why) {
  void* base = nullptr;
  size_t bytes = 0;
  std::string refusal =
      mapCheckedMemfd(fd, ringLimits(maxCapacity), base, bytes);
  return fromMapping(std::move(refusal), base, bytes, why);
}

// ---- Writer ----

SharedRingWriter::SharedRingWriter(std::unique_ptr<SharedRingMemory> memory)
    : memory_(std::move(memory)),
      data_(static_cast<char*>(memory_->base()) + kRingHeaderBytes) {
  // A ring may be handed over with records in it (tests): go on after them.
  tail_ = tailWord(memory_->base()).load(std::memory_order_acquire);
}

size_t SharedRingWriter::pendingBytes() const {
  return static_cast<size_t>(
      tail_ - headWord(memory_->base()).load(std::memory_order_acquire));
}

SharedRingWriter::Push SharedRingWriter::push(
    const RingPiece* pieces,
    size_t count,
    uint64_t tag) {
  if (!why_.empty()) {
    return Push::kCorrupt;
  }
  size_t length = 0;
  for (size_t i = 0; i < count; ++i) {
    length += pieces[i].length;
  }
  if (length > maxRecordBytes()) {
    return Push::kTooLarge;
  }
  void* const base = memory_->base();
  const size_t capacity = memory_->capacity();
  const uint64_t head = headWord(base).load(std::memory_order_acquire);
  // Unsigned: a head ahead of our tail wraps to a huge count.
  const uint64_t used = tail_ - head;
  if (used > capacity) {
    why_ = "the reader's position in the shared ring is impossible (" +
        std::to_string(head) + " against " + std::to_string(tail_) +
        " written)";
    return Push::kCorrupt;
  }
  const size_t need = padded(length);
  if (need > capacity - used) {
    return Push::kFull;
  }
  unsigned char header[kRingRecordHeaderBytes] = {};
  const uint32_t length32 = static_cast<uint32_t>(length);
  std::memcpy(header, &length32, sizeof(length32));
  std::memcpy(header + 8, &tag, sizeof(tag));
  copyIn(data_, capacity, tail_, header, sizeof(header));
  uint64_t at = tail_ + kRingRecordHeaderBytes;
  for (size_t i = 0; i < count; ++i) {
    copyIn(data_, capacity, at, pieces[i].data, pieces[i].length);
    at += pieces[i].length;
  }
  tail_ += need;
  tailWord(base).store(tail_, std::memory_order_release);
  // Pairs with the fence in goingToSleep(): either the reader sees this
  // record after marking itself asleep, or we see the mark.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  std::atomic<uint32_t>& reader = readerWord(base);
  uint32_t state = reader.load(std::memory_order_relaxed);
  if (state == kAsleep &&
      reader
          .compare_exchange_strong(state, kBelled, std::memory_order_relaxed)) {
    return Push::kPushedRingBell;
  }
  return Push::kPushed;
}

// ---- Reader ----

SharedRingReader::SharedRingReader(std::unique_ptr<SharedRingMemory> memory)
    : memory_(std::move(memory)),
      data_(static_cast<const char*>(memory_->base()) + kRingHeaderBytes) {
  head_ = headWord(memory_->base()).load(std::memory_order_acquire);
}

bool SharedRingReader::hasRecords(uint64_t& tail) const {
  void* const base = memory_->base();
  tail = tailWord(base).load(std::memory_order_acquire);
  return tail != headWord(base).load(std::memory_order_relaxed);
}

SharedRingReader::Read SharedRingReader::peek(uint64_t& tag, size_t& length) {
  peeked_ = false;
  if (!why_.empty()) {
    return Read::kCorrupt;
  }
  const size_t capacity = memory_->capacity();
  const uint64_t tail =
      tailWord(memory_->base()).load(std::memory_order_acquire);
  const uint64_t published = tail - head_;
  if (published == 0) {
    return Read::kEmpty;
  }
  if (published > capacity || published < kRingRecordHeaderBytes) {
    why_ = "the writer's position in the shared ring is impossible (" +
        std::to_string(tail) + " against " + std::to_string(head_) + " read)";
    return Read::kCorrupt;
  }
  unsigned char header[kRingRecordHeaderBytes];
  copyOut(data_, capacity, head_, header, sizeof(header));
  uint32_t length32 = 0;
  std::memcpy(&length32, header, sizeof(length32));
  std::memcpy(&tag, header + 8, sizeof(tag));
  if (length32 > maxRecordBytes() || padded(length32) > published) {
    why_ = "a record in the shared ring claims " + std::to_string(length32) +
        " bytes, more than the " +
        std::to_string(published - kRingRecordHeaderBytes) + " published";
    return Read::kCorrupt;
  }
  length = length32;
  peekedLength_ = length32;
  peeked_ = true;
  return Read::kRecord;
}

void SharedRingReader::take(void* out) {
  TORCH_INTERNAL_ASSERT(peeked_, "SharedRingReader::take() without peek()");
  copyOut(
      data_,
      memory_->capacity(),
      head_ + kRingRecordHeaderBytes,
      out,
      peekedLength_);
  head_ += padded(peekedLength_);
  peeked_ = false;
  headWord(memory_->base()).store(head_, std::memory_order_release);
}

void SharedRingReader::polling() {
  readerWord(memory_->base()).store(kPolling, std::memory_order_relaxed);
}

bool SharedRingReader::goingToSleep() {
  readerWord(memory_->base()).store(kAsleep, std::memory_order_relaxed);
  // Pairs with the writer's fence after publishing (Note [Shared rings for
  // small frames]). Any thread: the published head, not ours.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  uint64_t tail = 0;
  return !hasRecords(tail);
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
