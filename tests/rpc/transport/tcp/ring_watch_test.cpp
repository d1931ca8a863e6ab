// The watch over a transport's shared rings (Note [Rings while the loop
// polls] in rpc/transport/tcp/ring_watch.h): rings are marked polling while
// a thread polls and asleep otherwise, a look posts once per new record,
// and a record that came as the last poller left is posted, not lost.

#include <gtest/gtest.h>

#include <memory>
#include <string>

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

} // namespace
} // namespace torchrpc
