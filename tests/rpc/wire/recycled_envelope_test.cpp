// Tier 1: envelopes reused from message to message (Note [Recycled
// envelopes] in rpc/wire/recycled_envelope.h). Each test runs its part on a
// thread of its own, so that it starts with nothing kept.

#include "torchrpc/rpc/wire/recycled_envelope.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "proto/rpc/envelope.pb.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/wire/envelope.h"
#include "torchrpc/rpc/wire/value_codec.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace {

template <typename F>
void onNewThread(F&& fn) {
  std::thread thread(std::forward<F>(fn));
  thread.join();
}

// Sets every kind of field a message may carry, within what may be kept.
void fillEverything(wire::Envelope& envelope) {
  envelope.set_version(7);
  envelope.set_id(42);
  envelope.set_kind(3);
  envelope.set_is_response(true);
  envelope.set_from_worker(5);
  envelope.set_timeout_ms(900);
  envelope.set_traced(true);
  envelope.set_body("a body");
  envelope.mutable_status()->set_code(4);
  envelope.mutable_status()->set_message("failed");
  (*envelope.mutable_metadata())["hook"] = "metadata";
  envelope.add_values()->set_int_value(11);
  envelope.add_values()->mutable_list()->add_elements()->set_bool_value(true);
  auto* tensor = envelope.add_tensors();
  tensor->set_dtype(6);
  tensor->add_sizes(2);
  tensor->add_sizes(3);
  tensor->set_requires_grad(true);
}

TEST(RecycledEnvelope, AReleasedEnvelopeComesBackEmpty) {
  onNewThread([] {
    RecycledEnvelope first = takeEnvelope();
    fillEverything(*first);
    const wire::Envelope* address = first.get();
    first.reset();
    EXPECT_EQ(keptEnvelopesOnThisThread(), 1);

    RecycledEnvelope again = takeEnvelope();
    EXPECT_EQ(again.get(), address);
    EXPECT_EQ(keptEnvelopesOnThisThread(), 0);
    EXPECT_EQ(again->ByteSizeLong(), 0u);
    EXPECT_EQ(again->SerializeAsString(), "");
    EXPECT_FALSE(again->has_status());
    EXPECT_EQ(again->values_size(), 0);
    EXPECT_EQ(again->tensors_size(), 0);
    EXPECT_EQ(again->metadata_size(), 0);
  });
}

TEST(RecycledEnvelope, AThreadKeepsAtMostFour) {
  onNewThread([] {
    std::vector<RecycledEnvelope> taken;
    for (int i = 0; i < 6; ++i) {
      taken.push_back(takeEnvelope());
    }
    taken.clear();
    EXPECT_EQ(keptEnvelopesOnThisThread(), 4);
  });
}

// One limit of the kept envelope's contents, just within it and just over.
struct Limit {
  const char* name;
  void (*fill)(wire::Envelope&, int count);
  int most;
};

const Limit kLimits[] = {
    {"values",
     [](wire::Envelope& e, int n) {
       for (int i = 0; i < n; ++i) {
         e.add_values()->set_int_value(i);
       }
     },
     16},
    {"tensors",
     [](wire::Envelope& e, int n) {
       for (int i = 0; i < n; ++i) {
         e.add_tensors()->add_sizes(1);
       }
     },
     16},
    {"dimensions",
     [](wire::Envelope& e, int n) {
       auto* tensor = e.add_tensors();
       for (int i = 0; i < n; ++i) {
         tensor->add_sizes(1);
       }
     },
     16},
    {"metadata entries",
     [](wire::Envelope& e, int n) {
       for (int i = 0; i < n; ++i) {
         (*e.mutable_metadata())["hook" + std::to_string(i)] = "x";
       }
     },
     8},
    {"body bytes",
     [](wire::Envelope& e, int n) { e.set_body(std::string(n, 'b')); },
     4096},
};

TEST(RecycledEnvelope, OnlyEnvelopesOfSmallMessagesAreKept) {
  for (const auto& limit : kLimits) {
    SCOPED_TRACE(limit.name);
    onNewThread([&] {
      RecycledEnvelope within = takeEnvelope();
      limit.fill(*within, limit.most);
      within.reset();
      EXPECT_EQ(keptEnvelopesOnThisThread(), 1);

      RecycledEnvelope over = takeEnvelope();
      limit.fill(*over, limit.most + 1);
      over.reset();
      EXPECT_EQ(keptEnvelopesOnThisThread(), 0);
    });
  }
}

TEST(RecycledEnvelope, AnEnvelopeJoinsTheCacheOfTheThreadThatReleasesIt) {
  RecycledEnvelope moved;
  int keptByTaker = -1;
  int keptByReleaser = -1;
  onNewThread([&] {
    moved = takeEnvelope();
    fillEverything(*moved);
    keptByTaker = keptEnvelopesOnThisThread();
  });
  onNewThread([&] {
    moved.reset();
    keptByReleaser = keptEnvelopesOnThisThread();
  });
  EXPECT_EQ(keptByTaker, 0);
  EXPECT_EQ(keptByReleaser, 1);
}

// An envelope a thread_local object releases after the thread's cache was
// closed is deleted, not kept where nobody would delete it (LeakSanitizer
// reports it then).
std::atomic<int> keptAfterTheLateRelease{-1};

struct HeldUntilTheThreadEnds {
  RecycledEnvelope envelope = takeEnvelope();
  ~HeldUntilTheThreadEnds() {
    envelope.reset();
    keptAfterTheLateRelease = keptEnvelopesOnThisThread();
  }
};

TEST(RecycledEnvelope, AnEnvelopeReleasedWhileTheThreadEndsIsDeleted) {
  onNewThread([] {
    // Constructed before the cache's first keep, so destroyed after it.
    thread_local HeldUntilTheThreadEnds held;
    takeEnvelope().reset();
    EXPECT_EQ(keptEnvelopesOnThisThread(), 1);
  });
  EXPECT_EQ(keptAfterTheLateRelease.load(), 0);
}

TEST(RecycledEnvelope, DescriptorsAreBuiltInTheElementsAnEnvelopeKept) {
  wire::Envelope envelope;
  {
    ValueEncoder encoder(1, nullptr, nullptr);
    encoder.reuseDescriptorsOf(&envelope);
    encoder.encode(at::ones({4, 5, 6}, at::kDouble), envelope.add_values());
    std::move(encoder).finish(&envelope);
  }
  ASSERT_EQ(envelope.tensors_size(), 1);
  const wire::TensorDesc* kept = &envelope.tensors(0);
  envelope.Clear();

  ValueEncoder encoder(1, nullptr, nullptr);
  encoder.reuseDescriptorsOf(&envelope);
  encoder.encode(at::ones({2}), envelope.add_values());
  auto tensors = std::move(encoder).finish(&envelope);
  ASSERT_EQ(envelope.tensors_size(), 1);
  EXPECT_EQ(&envelope.tensors(0), kept);
  EXPECT_EQ(envelope.tensors(0).dtype(), static_cast<uint32_t>(at::kFloat));
  ASSERT_EQ(envelope.tensors(0).sizes_size(), 1);
  EXPECT_EQ(envelope.tensors(0).sizes(0), 2);
  ASSERT_EQ(tensors.size(), 1u);
  EXPECT_EQ(tensors[0].nbytes(), 8u);
}

// The codec on recycled envelopes: a message encoded after a larger one is
// byte for byte what a thread with nothing kept encodes.
TEST(RecycledEnvelope, AMessageAfterALargerOneCarriesNothingOfIt) {
  Options options;
  MessageCodec codec(WorkerInfo{"worker0", 0}, options);
  const WorkerInfo to{"worker1", 1};

  OutgoingRequest small;
  small.kind = 17;
  small.body = "f";
  small.values = {c10::IValue(at::ones({2}))};

  std::string fresh;
  onNewThread(
      [&] { fresh = codec.encodeRequest(to, 9, small, nullptr).header; });

  std::string afterLarger;
  onNewThread([&] {
    OutgoingRequest larger;
    larger.kind = 18;
    larger.body = "a longer body";
    larger.timeout = std::chrono::milliseconds(500);
    larger.values = {
        c10::IValue(at::ones({2, 3})),
        c10::IValue(at::ones({4, 5, 6}, at::kDouble)),
        c10::IValue(std::vector<int64_t>{1, 2}),
        c10::IValue("text")};
    codec.encodeRequest(to, 8, larger, nullptr, /*traced=*/true);
    codec.encodeError(
        8,
        18,
        std::make_exception_ptr(std::runtime_error("failed")),
        "larger");
    EXPECT_GE(keptEnvelopesOnThisThread(), 1);
    afterLarger = codec.encodeRequest(to, 9, small, nullptr).header;
  });
  EXPECT_FALSE(fresh.empty());
  EXPECT_EQ(afterLarger, fresh);
}

} // namespace
} // namespace detail
} // namespace rpc
} // namespace torchrpc
