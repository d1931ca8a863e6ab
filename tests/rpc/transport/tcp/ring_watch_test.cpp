// The watch over a transport's shared rings (Note [Rings while the loop
// polls] in rpc/transport/tcp/ring_watch.h): rings are marked polling while
// a thread polls and asleep otherwise, a look posts once per new record,
// and a record that came as the last poller left is posted, not lost, also
// while threads start and stop polling at random against the writer.

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "torchrpc/rpc/transport/tcp/ring_watch.h"
#include "torchrpc/rpc/transport/tcp/shared_ring.h"

namespace torchrpc {
namespace {

using rpc::detail::tcp::RingWatch;
using rpc::detail::tcp::SharedRingMemory;
using rpc::detail::tcp::SharedRingReader;
using rpc::detail::tcp::SharedRingWriter;
using Push = SharedRingWriter::Push;

// A ring read here and written through a second mapping, as a peer would.
struct Ring {
  Ring() {
    std::string why;
    auto memory = SharedRingMemory::create(4096, 7, why);
    EXPECT_NE(memory, nullptr) << why;
    const int fd = memory->fd();
    reader = std::make_shared<SharedRingReader>(std::move(memory));
    auto mapped = SharedRingMemory::mapOwn(fd, 4096, why);
    EXPECT_NE(mapped, nullptr) << why;
    writer = std::make_unique<SharedRingWriter>(std::move(mapped));
  }
  Push push() {
    const char byte = 'r';
    return writer->push(&byte, 1, 0);
  }
  void drain() {
    uint64_t tag = 0;
    size_t length = 0;
    char byte = 0;
    while (reader->peek(tag, length) == SharedRingReader::Read::kRecord) {
      reader->take(&byte);
    }
  }
  std::shared_ptr<SharedRingReader> reader;
  std::unique_ptr<SharedRingWriter> writer;
};

TEST(RingWatch, RingsAreMarkedPollingOnlyWhileAThreadPolls) {
  RingWatch watch;
  Ring ring;
  int posts = 0;
  watch.add(ring.reader, [&posts]() { ++posts; });
  // Nobody polls: the first record rings, the next does not.
  EXPECT_EQ(ring.push(), Push::kPushedRingBell);
  EXPECT_EQ(ring.push(), Push::kPushed);
  ring.drain();
  // Two threads poll; one leaves, the other still polls.
  watch.beginPolling();
  watch.beginPolling();
  EXPECT_TRUE(watch.markedPolling());
  EXPECT_EQ(ring.push(), Push::kPushed);
  ring.drain();
  watch.endPolling();
  EXPECT_EQ(ring.push(), Push::kPushed);
  ring.drain();
  // The last one leaves: asleep again, so the next record rings.
  watch.endPolling();
  EXPECT_FALSE(watch.markedPolling());
  EXPECT_EQ(ring.push(), Push::kPushedRingBell);
  // A ring added while threads poll is marked polling at once.
  watch.beginPolling();
  Ring second;
  watch.add(second.reader, []() {});
  EXPECT_EQ(second.push(), Push::kPushed);
  watch.endPolling();
}

TEST(RingWatch, ALookPostsOncePerNewRecord) {
  RingWatch watch;
  Ring ring;
  int posts = 0;
  watch.add(ring.reader, [&posts]() { ++posts; });
  watch.beginPolling();
  watch.check();
  EXPECT_EQ(posts, 0);
  ring.push();
  watch.check();
  EXPECT_EQ(posts, 1);
  // Not read yet (it may follow a frame still on the socket): not posted
  // again until the writer publishes more.
  watch.check();
  watch.check();
  EXPECT_EQ(posts, 1);
  ring.push();
  watch.check();
  EXPECT_EQ(posts, 2);
  ring.drain();
  watch.check();
  EXPECT_EQ(posts, 2);
  watch.endPolling();
}

TEST(RingWatch, ARecordThatCameAsTheLastPollerLeftIsPosted) {
  RingWatch watch;
  Ring ring;
  int posts = 0;
  watch.add(ring.reader, [&posts]() { ++posts; });
  watch.beginPolling();
  // Written while the reader polled: no bell.
  EXPECT_EQ(ring.push(), Push::kPushed);
  // Nobody looked before the last poller left: it posts, since no bell
  // will come for this record.
  watch.endPolling();
  EXPECT_EQ(posts, 1);
  // Read, then asleep with nothing pending: no post.
  ring.drain();
  watch.beginPolling();
  watch.endPolling();
  EXPECT_EQ(posts, 1);
  // A ring added with a record in it while nobody polls is posted too.
  Ring full;
  EXPECT_EQ(full.push(), Push::kPushed);
  int fullPosts = 0;
  watch.add(full.reader, [&fullPosts]() { ++fullPosts; });
  EXPECT_EQ(fullPosts, 1);
}

TEST(RingWatch, ARecordPostedOnceIsNotPostedAgainWhenPollersLeave) {
  // A record not due yet (it follows a frame still on the socket) stays in
  // the ring after its post: posting it again whenever the last poller
  // leaves would spin the loop until the socket brings that frame.
  RingWatch watch;
  Ring ring;
  int posts = 0;
  watch.add(ring.reader, [&posts]() { ++posts; });
  watch.beginPolling();
  ring.push();
  watch.check();
  EXPECT_EQ(posts, 1);
  for (int i = 0; i < 5; ++i) {
    watch.endPolling();
    watch.beginPolling();
  }
  watch.endPolling();
  EXPECT_EQ(posts, 1);
  // A new record is posted.
  watch.beginPolling();
  ring.push();
  watch.endPolling();
  EXPECT_EQ(posts, 2);
}

TEST(RingWatch, ARemovedRingIsNotLookedAtAndItsCallbackIsReleased) {
  RingWatch watch;
  Ring ring;
  auto held = std::make_shared<int>(0);
  const uint64_t id = watch.add(ring.reader, [held]() { ++*held; });
  EXPECT_EQ(watch.size(), 1u);
  EXPECT_EQ(held.use_count(), 2);
  watch.remove(id);
  EXPECT_EQ(watch.size(), 0u);
  EXPECT_EQ(held.use_count(), 1);
  watch.beginPolling();
  ring.push();
  watch.check();
  watch.endPolling();
  EXPECT_EQ(*held, 0);
  watch.remove(id); // twice: nothing
}

// The watch's promise under real concurrency: a record is never left where
// no thread will look. Here a "loop" thread sleeps until something wakes it
// (a post, or the writer's bell), then polls a few turns and drains, as an
// io thread does; two "waiters" poll the loop in one short burst per
// record, starting and stopping at random against each other, the loop and
// the push; the writer pushes one record at a time and waits for it to be
// read. A lost wake-up (a record written as the last poller left, seen by
// nobody, with no bell) leaves a record unread, and the writer's wait for
// it times out.
TEST(RingWatch, ThreadsThatStartAndStopPollingLoseNoRecord) {
  constexpr int kRecords = 20000;
  constexpr auto kWaitPerRecord = std::chrono::seconds(5);
  RingWatch watch;
  Ring ring;

  std::mutex mutex;
  std::condition_variable wake; // the loop's "epoll"
  std::condition_variable consumed;
  bool woken = false;
  int read = 0;
  bool stop = false;
  auto wakeLoop = [&]() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      woken = true;
    }
    wake.notify_one();
  };
  watch.add(ring.reader, wakeLoop);

  // Drains what is there; the reader's side is this thread's only.
  auto drain = [&]() {
    uint64_t tag = 0;
    size_t length = 0;
    char byte = 0;
    int taken = 0;
    while (ring.reader->peek(tag, length) == SharedRingReader::Read::kRecord) {
      ring.reader->take(&byte);
      ++taken;
    }
    if (taken > 0) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        read += taken;
      }
      consumed.notify_all();
    }
  };
  std::thread loop([&]() {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex);
        wake.wait(lock, [&]() { return woken || stop; });
        if (stop) {
          return;
        }
        woken = false;
      }
      watch.beginPolling();
      for (int turn = 0; turn < 3; ++turn) {
        drain();
        watch.check();
      }
      watch.endPolling();
      // A post from endPolling() or a waiter's check() has set `woken`:
      // the next wait returns at once.
    }
  });

  // Each record sets the waiters off on one burst of polling, which races
  // with its push; after the burst they stay off the loop until the next
  // record, as a waiter whose wait has ended does. So once the bursts end,
  // only the loop, woken by a post or the bell, can read the record.
  std::mutex goMutex;
  std::condition_variable go;
  int round = 0;
  bool writing = true;
  auto shortPause = [](unsigned& seed) {
    seed = seed * 1103515245u + 12345u;
    for (unsigned i = 0; i < (seed >> 16) % 8; ++i) {
      std::this_thread::yield();
    }
  };
  std::vector<std::thread> waiters;
  for (int w = 0; w < 2; ++w) {
    waiters.emplace_back([&, w]() {
      unsigned seed = 12345u + unsigned(w);
      int seen = 0;
      for (;;) {
        {
          std::unique_lock<std::mutex> lock(goMutex);
          go.wait(lock, [&]() { return round != seen || !writing; });
          if (!writing) {
            return;
          }
          seen = round;
        }
        shortPause(seed);
        watch.beginPolling();
        for (unsigned turn = 0; turn < (seed >> 20) % 4; ++turn) {
          watch.check();
        }
        watch.endPolling();
      }
    });
  }

  unsigned seed = 777u;
  int bells = 0;
  int lost = -1;
  int badPush = -1;
  for (int i = 0; i < kRecords && lost < 0 && badPush < 0; ++i) {
    {
      std::lock_guard<std::mutex> lock(goMutex);
      ++round;
    }
    go.notify_all();
    shortPause(seed);
    const Push pushed = ring.push();
    if (pushed == Push::kPushedRingBell) {
      ++bells;
      wakeLoop();
    } else if (pushed != Push::kPushed) {
      badPush = int(pushed);
      break;
    }
    std::unique_lock<std::mutex> lock(mutex);
    if (!consumed.wait_for(lock, kWaitPerRecord, [&]() {
          return read == i + 1;
        })) {
      lost = i;
    }
  }
  {
    std::lock_guard<std::mutex> lock(goMutex);
    writing = false;
  }
  go.notify_all();
  for (std::thread& waiter : waiters) {
    waiter.join();
  }
  {
    std::lock_guard<std::mutex> lock(mutex);
    stop = true;
  }
  wake.notify_one();
  loop.join();
  EXPECT_EQ(badPush, -1) << "a push returned " << badPush;
  EXPECT_EQ(lost, -1) << "record " << lost
                      << " was never read: no thread looked and no bell rang";
  // Both ways of waking happened: records that found the reader asleep
  // rang, the others were seen by a poller.
  EXPECT_GT(bells, 0);
  EXPECT_LT(bells, kRecords);
}

} // namespace
} // namespace torchrpc
