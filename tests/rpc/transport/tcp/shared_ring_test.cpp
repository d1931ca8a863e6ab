// The ring of small records shared by two processes of one host (Note
// [Shared rings for small frames] in rpc/transport/tcp/shared_ring.h):
// records in order and intact across the area's end, room and its limits,
// the bell, refusals of a peer that writes impossible positions or
// records, refusals of descriptors that are not rings, and two processes
// echoing through a pair of rings.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/child_processes.h"
#include "torchrpc/rpc/transport/tcp/shared_ring.h"

namespace torchrpc {
namespace {

using rpc::detail::tcp::kRingHeaderBytes;
using rpc::detail::tcp::kRingRecordHeaderBytes;
using rpc::detail::tcp::ringBytesFor;
using rpc::detail::tcp::SharedRingMemory;
using rpc::detail::tcp::SharedRingReader;
using rpc::detail::tcp::SharedRingWriter;
using Push = SharedRingWriter::Push;
using Read = SharedRingReader::Read;

constexpr size_t kCapacity = 4096;

// `length` bytes that depend on `seed` and on their position.
std::string recordBytes(size_t length, uint64_t seed) {
  std::string bytes(length, '\0');
  for (size_t i = 0; i < length; ++i) {
    bytes[i] = static_cast<char>((seed * 131 + i * 7) & 0xff);
  }
  return bytes;
}

// A ring made here, written through this mapping; readerOf() maps it again
// to read it, as a peer would.
struct MadeRing {
  int fd = -1;
  std::unique_ptr<SharedRingWriter> writer;
};

MadeRing makeRing(size_t capacity = kCapacity) {
  std::string why;
  auto memory = SharedRingMemory::create(capacity, 7, why);
  EXPECT_NE(memory, nullptr) << why;
  MadeRing ring;
  if (memory) {
    ring.fd = memory->fd();
    ring.writer = std::make_unique<SharedRingWriter>(std::move(memory));
  }
  return ring;
}

std::unique_ptr<SharedRingReader> readerOf(
    const MadeRing& ring,
    size_t maxCapacity = kCapacity) {
  std::string why;
  auto memory = SharedRingMemory::mapOwn(ring.fd, maxCapacity, why);
  EXPECT_NE(memory, nullptr) << why;
  if (!memory) {
    return nullptr;
  }
  return std::make_unique<SharedRingReader>(std::move(memory));
}

// Takes the oldest record; fails the test if there is none.
std::string takeOne(SharedRingReader& reader, uint64_t& tag) {
  size_t length = 0;
  const Read read = reader.peek(tag, length);
  EXPECT_EQ(read, Read::kRecord) << reader.why();
  if (read != Read::kRecord) {
    return std::string();
  }
  std::string bytes(length, '\0');
  reader.take(bytes.data());
  return bytes;
}

// The ring's memory as the peer sees it: a second mapping of its memfd.
struct RawRing {
  explicit RawRing(const MadeRing& ring)
      : bytes(ringBytesFor(ring.writer->capacity())) {
    base = static_cast<char*>(
        ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, ring.fd, 0));
    EXPECT_NE(base, MAP_FAILED);
  }
  ~RawRing() {
    ::munmap(base, bytes);
  }
  void setTail(uint64_t value) {
    std::memcpy(base, &value, sizeof(value));
  }
  void setHead(uint64_t value) {
    std::memcpy(base + 64, &value, sizeof(value));
  }
  char* data() {
    return base + kRingHeaderBytes;
  }
  size_t bytes;
  char* base = nullptr;
};

TEST(SharedRing, RecordsComeOutAsTheyWentInAcrossTheAreasEnd) {
  MadeRing ring = makeRing();
  auto reader = readerOf(ring);
  ASSERT_TRUE(ring.writer && reader);
  SharedRingWriter* writer = ring.writer.get();
  // Lengths that are and are not multiples of the padding, the empty
  // record and the longest; three records at a time, so that records
  // (and their headers) straddle the end of the area many times.
  const std::vector<size_t> lengths =
      {0, 1, 7, 8, 9, 100, 1000, 1361, 4, writer->maxRecordBytes() / 3};
  uint64_t pushed = 0;
  uint64_t taken = 0;
  for (int round = 0; round < 300; ++round) {
    for (int i = 0; i < 3; ++i, ++pushed) {
      const size_t length = lengths[pushed % lengths.size()];
      ASSERT_EQ(
          writer->push(recordBytes(length, pushed).data(), length, pushed),
          Push::kPushed)
          << "record " << pushed;
    }
    for (; taken < pushed; ++taken) {
      uint64_t tag = 0;
      const std::string got = takeOne(*reader, tag);
      ASSERT_EQ(tag, taken);
      ASSERT_EQ(got, recordBytes(lengths[taken % lengths.size()], taken))
          << "record " << taken;
    }
    uint64_t tag = 0;
    size_t length = 0;
    ASSERT_EQ(reader->peek(tag, length), Read::kEmpty);
  }
  EXPECT_EQ(writer->pendingBytes(), 0u);
  // The longest record fits an empty ring, one byte more never does.
  const size_t longest = writer->maxRecordBytes();
  EXPECT_EQ(longest, kCapacity - kRingRecordHeaderBytes);
  EXPECT_EQ(
      writer->push(recordBytes(longest, 1).data(), longest, 7),
      Push::kPushed);
  uint64_t tag = 0;
  EXPECT_EQ(takeOne(*reader, tag), recordBytes(longest, 1));
  EXPECT_EQ(tag, 7u);
  const std::string tooLong(longest + 1, 'x');
  EXPECT_EQ(writer->push(tooLong.data(), tooLong.size(), 8), Push::kTooLarge);
}

TEST(SharedRing, AFullRingTakesNothingUntilTheReaderConsumes) {
  MadeRing ring = makeRing();
  auto reader = readerOf(ring);
  ASSERT_TRUE(ring.writer && reader);
  SharedRingWriter* writer = ring.writer.get();
  // 100 bytes take 16 + 104: 34 fit in 4096 (4080), the 35th does not.
  const std::string record = recordBytes(100, 3);
  int accepted = 0;
  while (writer->push(record.data(), record.size(), accepted) ==
         Push::kPushed) {
    ++accepted;
    ASSERT_LT(accepted, 100);
  }
  EXPECT_EQ(accepted, 34);
  EXPECT_EQ(writer->pendingBytes(), 34u * 120);
  EXPECT_EQ(writer->push(record.data(), record.size(), 99), Push::kFull);
  uint64_t tag = 99;
  EXPECT_EQ(takeOne(*reader, tag), record);
  EXPECT_EQ(tag, 0u);
  EXPECT_EQ(writer->push(record.data(), record.size(), 34), Push::kPushed);
  // Nothing was lost or reordered by the refusal.
  for (uint64_t i = 1; i <= 34; ++i) {
    EXPECT_EQ(takeOne(*reader, tag), record);
    EXPECT_EQ(tag, i);
  }
}

TEST(SharedRing, TheBellRingsOnceForAReaderThatSleeps) {
  MadeRing ring = makeRing();
  auto reader = readerOf(ring);
  ASSERT_TRUE(ring.writer && reader);
  SharedRingWriter* writer = ring.writer.get();
  const char byte = 'b';
  // A new ring's reader counts as polling.
  EXPECT_EQ(writer->push(&byte, 1, 0), Push::kPushed);
  // A reader with a record waiting may not sleep.
  EXPECT_FALSE(reader->goingToSleep());
  uint64_t tag = 0;
  takeOne(*reader, tag);
  EXPECT_TRUE(reader->goingToSleep());
  // The first record after it went to sleep rings, the next ones do not.
  EXPECT_EQ(writer->push(&byte, 1, 1), Push::kPushedRingBell);
  EXPECT_EQ(writer->push(&byte, 1, 2), Push::kPushed);
  EXPECT_EQ(writer->push(&byte, 1, 3), Push::kPushed);
  // Woken, it polls: no bell while it does.
  reader->polling();
  for (int i = 1; i <= 3; ++i) {
    takeOne(*reader, tag);
    EXPECT_EQ(tag, uint64_t(i));
  }
  EXPECT_EQ(writer->push(&byte, 1, 4), Push::kPushed);
  takeOne(*reader, tag);
  // Asleep again: the next record rings again.
  EXPECT_TRUE(reader->goingToSleep());
  EXPECT_EQ(writer->push(&byte, 1, 5), Push::kPushedRingBell);
}

TEST(SharedRing, AReaderRefusesImpossiblePositionsAndRecords) {
  {
    MadeRing ring = makeRing();
    auto reader = readerOf(ring);
    ASSERT_TRUE(ring.writer && reader);
    RawRing raw(ring);
    // A tail more than the area ahead of what was read.
    raw.setTail(kCapacity + 16);
    uint64_t tag = 0;
    size_t length = 0;
    EXPECT_EQ(reader->peek(tag, length), Read::kCorrupt);
    EXPECT_EQ(
        reader->why(),
        "the writer's position in the shared ring is impossible (4112 "
        "against 0 read)");
    // The refusal sticks, whatever the peer writes next.
    raw.setTail(0);
    EXPECT_EQ(reader->peek(tag, length), Read::kCorrupt);
  }
  {
    MadeRing ring = makeRing();
    auto reader = readerOf(ring);
    ASSERT_TRUE(ring.writer && reader);
    RawRing raw(ring);
    // Less than a record header published.
    raw.setTail(8);
    uint64_t tag = 0;
    size_t length = 0;
    EXPECT_EQ(reader->peek(tag, length), Read::kCorrupt);
    EXPECT_EQ(
        reader->why(),
        "the writer's position in the shared ring is impossible (8 against "
        "0 read)");
  }
  {
    MadeRing ring = makeRing();
    auto reader = readerOf(ring);
    ASSERT_TRUE(ring.writer && reader);
    SharedRingWriter* writer = ring.writer.get();
    RawRing raw(ring);
    const std::string record = recordBytes(10, 1);
    ASSERT_EQ(writer->push(record.data(), record.size(), 1), Push::kPushed);
    // The record's length rewritten past what was published (16 + 16).
    const uint32_t claimed = 5000;
    std::memcpy(raw.data(), &claimed, sizeof(claimed));
    uint64_t tag = 0;
    size_t length = 0;
    EXPECT_EQ(reader->peek(tag, length), Read::kCorrupt);
    EXPECT_EQ(
        reader->why(),
        "a record in the shared ring claims 5000 bytes, more than the 16 "
        "published");
  }
}

TEST(SharedRing, AWriterRefusesAnImpossibleReaderPosition) {
  MadeRing ring = makeRing();
  ASSERT_TRUE(ring.writer);
  SharedRingWriter* writer = ring.writer.get();
  RawRing raw(ring);
  const char byte = 'w';
  ASSERT_EQ(writer->push(&byte, 1, 0), Push::kPushed); // tail 24
  // A head ahead of the tail.
  raw.setHead(100);
  EXPECT_EQ(writer->push(&byte, 1, 1), Push::kCorrupt);
  EXPECT_EQ(
      writer->why(),
      "the reader's position in the shared ring is impossible (100 against "
      "24 written)");
  // A head more than the area behind it cannot be written either: the
  // tail is 24, and a head that far behind wraps as a huge count too.
  raw.setHead(uint64_t(24) - kCapacity - 8);
  EXPECT_EQ(writer->push(&byte, 1, 1), Push::kCorrupt);
  // The refusal sticks, whatever the peer writes next.
  raw.setHead(24);
  EXPECT_EQ(writer->push(&byte, 1, 1), Push::kCorrupt);
}

TEST(SharedRing, OnlySealedPowerOfTwoMemfdsOfBoundedSizeAreMapped) {
  std::string why;
  int pipeFds[2];
  ASSERT_EQ(::pipe(pipeFds), 0);
  EXPECT_EQ(SharedRingMemory::mapOwn(pipeFds[0], kCapacity, why), nullptr);
  EXPECT_EQ(why, "shared ring is not a memfd on tmpfs");
  ::close(pipeFds[0]);
  ::close(pipeFds[1]);

  // A memfd its owner could shrink under our mapping (SIGBUS).
  int unsealed = ::memfd_create("unsealed", MFD_CLOEXEC);
  ASSERT_GE(unsealed, 0);
  ASSERT_EQ(::ftruncate(unsealed, off_t(ringBytesFor(kCapacity))), 0);
  EXPECT_EQ(SharedRingMemory::mapOwn(unsealed, kCapacity, why), nullptr);
  EXPECT_EQ(why, "shared ring is not sealed against shrinking");
  ::close(unsealed);

  auto sealedOf = [](size_t bytes) {
    int fd = ::memfd_create("sealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(::ftruncate(fd, off_t(bytes)), 0);
    EXPECT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
    return fd;
  };
  int small = sealedOf(kRingHeaderBytes + 64);
  EXPECT_EQ(SharedRingMemory::mapOwn(small, kCapacity, why), nullptr);
  EXPECT_EQ(why, "shared ring is too small");
  ::close(small);

  int odd = sealedOf(kRingHeaderBytes + 3 * 4096);
  EXPECT_EQ(SharedRingMemory::mapOwn(odd, 4 * 4096, why), nullptr);
  EXPECT_EQ(why, "shared ring's data area is not a power of two");
  ::close(odd);

  MadeRing big = makeRing(8 * kCapacity);
  ASSERT_TRUE(big.writer);
  EXPECT_EQ(SharedRingMemory::mapOwn(big.fd, 4 * kCapacity, why), nullptr);
  EXPECT_EQ(why, "shared ring is larger than this connection accepts");
  EXPECT_NE(SharedRingMemory::mapOwn(big.fd, 8 * kCapacity, why), nullptr);

  EXPECT_EQ(
      SharedRingMemory::mapPeer(::getpid(), 1 << 30, kCapacity, why),
      nullptr);
  EXPECT_EQ(
      why,
      "cannot open the peer's shared ring: No such file or directory");

  EXPECT_THROW(SharedRingMemory::create(3000, 7, why), c10::Error);
  EXPECT_THROW(SharedRingMemory::create(2048, 7, why), c10::Error);
}

// ---- Two processes ----

// A reader's wait for its next record: polls the ring `spins` times, then
// goes to sleep on `bell` (a pipe the writer writes a byte to when push()
// says so) until `deadline`. False at the deadline or on a corrupt ring.
bool waitForRecord(
    SharedRingReader& reader,
    int bell,
    int spins,
    std::chrono::steady_clock::time_point deadline,
    uint64_t& tag,
    size_t& length) {
  for (;;) {
    for (int i = 0; i < spins; ++i) {
      const Read read = reader.peek(tag, length);
      if (read != Read::kEmpty) {
        return read == Read::kRecord;
      }
    }
    if (reader.goingToSleep()) {
      pollfd waiting{bell, POLLIN, 0};
      const int ready = ::poll(&waiting, 1, 100);
      if (ready == 1) {
        char bytes[64];
        (void)!::read(bell, bytes, sizeof(bytes));
      }
    }
    reader.polling();
    const Read read = reader.peek(tag, length);
    if (read != Read::kEmpty) {
      return read == Read::kRecord;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return false;
    }
  }
}

// Pushes, ringing `bell` when asked; retries a full ring until `deadline`.
bool pushRinging(
    SharedRingWriter& writer,
    int bell,
    const std::string& bytes,
    uint64_t tag,
    std::chrono::steady_clock::time_point deadline,
    int& bells) {
  for (;;) {
    const Push pushed = writer.push(bytes.data(), bytes.size(), tag);
    if (pushed == Push::kPushedRingBell) {
      ++bells;
      const char byte = 1;
      return ::write(bell, &byte, 1) == 1;
    }
    if (pushed == Push::kPushed) {
      return true;
    }
    if (pushed != Push::kFull || std::chrono::steady_clock::now() > deadline) {
      return false;
    }
  }
}

// How many of the pages of [base, base + bytes) this process has mapped
// (the "present" bit of /proc/self/pagemap, which needs no privilege), or
// -1 if pagemap cannot be read.
int presentPages(const void* base, size_t bytes) {
  const long page = ::sysconf(_SC_PAGESIZE);
  const int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return -1;
  }
  const uintptr_t first = reinterpret_cast<uintptr_t>(base) / page;
  const size_t count = (bytes + page - 1) / page;
  std::vector<uint64_t> entries(count);
  const ssize_t wanted = static_cast<ssize_t>(count * sizeof(uint64_t));
  const ssize_t got = ::pread(
      fd,
      entries.data(),
      wanted,
      static_cast<off_t>(first * sizeof(uint64_t)));
  ::close(fd);
  if (got != wanted) {
    return -1;
  }
  int present = 0;
  for (uint64_t entry : entries) {
    present += (entry >> 63) & 1;
  }
  return present;
}

TEST(SharedRing, EveryPageIsMappedOnBothSidesBeforeTheFirstRecord) {
  // A page first touched by a record cost a fault on the writer's copy in
  // and on the reader's copy out (about 50 µs per record of 4 KiB in the
  // first pass around a ring, bench/RESULTS.md): the maker's mapping and
  // the peer's have every page from the start.
  constexpr size_t kBigCapacity = 64 << 10;
  const size_t bytes = ringBytesFor(kBigCapacity);
  const int pages = static_cast<int>(bytes / ::sysconf(_SC_PAGESIZE));
  std::string why;
  auto made = SharedRingMemory::create(kBigCapacity, 7, why);
  ASSERT_NE(made, nullptr) << why;
  auto mapped = SharedRingMemory::mapOwn(made->fd(), kBigCapacity, why);
  ASSERT_NE(mapped, nullptr) << why;
  // A plain mapping of the same memfd, for contrast (and to show that
  // pagemap tells mappings apart): its pages come only as touched.
  void* plain =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, made->fd(), 0);
  ASSERT_NE(plain, MAP_FAILED);
  const int plainPresent = presentPages(plain, bytes);
  ::munmap(plain, bytes);
  if (plainPresent < 0) {
    GTEST_SKIP() << "/proc/self/pagemap cannot be read here";
  }
  EXPECT_EQ(plainPresent, 0);
  EXPECT_EQ(presentPages(made->base(), bytes), pages);
  EXPECT_EQ(presentPages(mapped->base(), bytes), pages);
}

TEST(SharedRing, TwoProcessesEchoThroughAPairOfRingsWakingEachOther) {
  // As a connection does: each side makes the ring it reads, and the
  // other side maps it to write. The child's ring reaches the parent by
  // its descriptor's number (mapped through /proc, as from a peer); the
  // parent's reaches the child over fork().
  constexpr int kRecords = 3000;
  constexpr uint64_t kStop = ~uint64_t(0);
  std::string why;
  auto repliesMemory = SharedRingMemory::create(16 * kCapacity, 7, why);
  ASSERT_NE(repliesMemory, nullptr) << why;
  const int repliesFd = repliesMemory->fd();
  SharedRingReader replies(std::move(repliesMemory));
  int bellToChild[2];
  int bellToParent[2];
  int fdNumber[2];
  ASSERT_EQ(::pipe(bellToChild), 0);
  ASSERT_EQ(::pipe(bellToParent), 0);
  ASSERT_EQ(::pipe(fdNumber), 0);

  testing::ChildProcesses children;
  const pid_t child = children.spawn([&]() {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::alarm(120);
    std::string why;
    auto requestsMemory = SharedRingMemory::create(16 * kCapacity, 11, why);
    ASSERT_NE(requestsMemory, nullptr) << why;
    const int number = requestsMemory->fd();
    SharedRingReader requests(std::move(requestsMemory));
    ASSERT_EQ(::write(fdNumber[1], &number, sizeof(number)), 4);
    auto toParentMemory =
        SharedRingMemory::mapOwn(repliesFd, 16 * kCapacity, why);
    ASSERT_NE(toParentMemory, nullptr) << why;
    SharedRingWriter toParent(std::move(toParentMemory));
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::seconds(60);
    int bells = 0;
    for (;;) {
      uint64_t tag = 0;
      size_t length = 0;
      // Sleeps at once when nothing is there: the parent must ring.
      ASSERT_TRUE(
          waitForRecord(requests, bellToChild[0], 1, deadline, tag, length))
          << requests.why();
      std::string bytes(length, '\0');
      requests.take(bytes.data());
      if (tag == kStop) {
        break;
      }
      for (char& c : bytes) {
        c = static_cast<char>(c + 1);
      }
      ASSERT_TRUE(pushRinging(
          toParent,
          bellToParent[1],
          bytes,
          tag * 2,
          deadline,
          bells));
    }
  });
  ASSERT_GT(child, 0);

  int number = -1;
  ASSERT_EQ(::read(fdNumber[0], &number, sizeof(number)), 4);
  auto toChildMemory =
      SharedRingMemory::mapPeer(child, number, 16 * kCapacity, why);
  ASSERT_NE(toChildMemory, nullptr) << why;
  // The child's header, as the child made it.
  EXPECT_EQ(toChildMemory->cookie(), 11u);
  SharedRingWriter toChild(std::move(toChildMemory));
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::seconds(60);
  int bells = 0;
  for (int i = 0; i < kRecords; ++i) {
    const std::string request = recordBytes(static_cast<size_t>(i % 700), i);
    ASSERT_TRUE(
        pushRinging(toChild, bellToChild[1], request, i, deadline, bells));
    uint64_t tag = 0;
    size_t length = 0;
    ASSERT_TRUE(
        waitForRecord(replies, bellToParent[0], 1000, deadline, tag, length))
        << replies.why();
    std::string reply(length, '\0');
    replies.take(reply.data());
    std::string expected = request;
    for (char& c : expected) {
      c = static_cast<char>(c + 1);
    }
    ASSERT_EQ(tag, uint64_t(i) * 2);
    ASSERT_EQ(reply, expected) << "record " << i;
  }
  // The child sleeps whenever it has answered, so requests had to wake it.
  EXPECT_GT(bells, 0);
  ASSERT_TRUE(pushRinging(toChild, bellToChild[1], "", kStop, deadline, bells));
  EXPECT_EQ(children.wait(child, std::chrono::seconds(30)), 0);
  for (int fd :
       {bellToChild[0],
        bellToChild[1],
        bellToParent[0],
        bellToParent[1],
        fdNumber[0],
        fdNumber[1]}) {
    ::close(fd);
  }
}

} // namespace
} // namespace torchrpc
