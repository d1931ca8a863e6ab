// The agent's extension points (message kinds, hooks, value extensions),
// its defences against bad input and its cancel message, over the
// in-process transport.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <set>
#include <thread>

#include "proto/rpc/envelope.pb.h"
#include "tests/support/local_cluster.h"
#include "torchrpc/rpc/request_cancellation.h"
#include "torchrpc/rpc/request_scope.h"
#include "torchrpc/rpc/transport/inprocess/inprocess_transport.h"
#include "torchrpc/rpc/wire/compact_envelope.h"
#include "torchrpc/rpc/wire/envelope.h"

namespace torchrpc {
namespace {

using namespace std::chrono_literals;
using rpc::ErrorCode;
using testing::LocalCluster;

// A raw connection to a worker, speaking the wire format by hand.
class RawPeer {
 public:
  RawPeer(LocalCluster& cluster, int rank)
      : transport_(cluster.network(), rpc::TransportLimits()) {
    auto bytes =
        cluster.store()->get("torchrpc/1/address/" + std::to_string(rank));
    connection_ = transport_.connect(std::string(bytes.begin(), bytes.end()));
    connection_->start(
        [this](rpc::Message&& message) {
          std::lock_guard<std::mutex> guard(mutex_);
          received_.push_back(std::move(message));
          cv_.notify_all();
        },
        [this](const rpc::TransportError&) {
          std::lock_guard<std::mutex> guard(mutex_);
          closed_ = true;
          cv_.notify_all();
        });
  }
  ~RawPeer() {
    transport_.close();
    transport_.join();
  }

  void send(std::string header, std::vector<at::Tensor> tensors = {}) {
    rpc::Message message{std::move(header), std::move(tensors)};
    connection_->send(std::move(message), [](const rpc::TransportError*) {});
  }

  // The next reply's header as it arrived; fails the test after a timeout.
  std::string nextReplyHeader() {
    std::unique_lock<std::mutex> lock(mutex_);
    bool got = cv_.wait_for(lock, 10s, [this]() { return !received_.empty(); });
    EXPECT_TRUE(got) << "no reply";
    std::string header;
    if (got) {
      header = std::move(received_.front().header);
      received_.pop_front();
    }
    return header;
  }

  // The next reply's envelope; fails the test after a timeout.
  rpc::wire::Envelope nextReply() {
    rpc::wire::Envelope envelope;
    EXPECT_TRUE(rpc::detail::parseEnvelope(nextReplyHeader(), &envelope));
    return envelope;
  }

  bool waitClosed() {
    std::unique_lock<std::mutex> lock(mutex_);
    return cv_.wait_for(lock, 10s, [this]() { return closed_; });
  }

 private:
  rpc::InProcessTransport transport_;
  std::shared_ptr<rpc::Connection> connection_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<rpc::Message> received_;
  bool closed_ = false;
};

rpc::wire::Envelope callEnvelope(uint64_t id, int64_t from, std::string fn) {
  rpc::wire::Envelope envelope;
  envelope.set_version(rpc::detail::kWireVersion);
  envelope.set_id(id);
  envelope.set_kind(rpc::kCallMessageKind);
  envelope.set_from_worker(from);
  envelope.set_body(std::move(fn));
  return envelope;
}

void registerAdd(int, rpc::Runtime& rt) {
  rt.functions().add("add", [](int64_t a, int64_t b) { return a + b; });
}

TEST(AgentInput, GarbageClosesThatConnectionOnlyAndTheWorkerKeepsServing) {
  LocalCluster cluster(rpc::TransportKind::kInProcess, 2, nullptr, registerAdd);
  RawPeer attacker(cluster, 1);
  attacker.send(std::string("\xff\xff\xff garbage \x01", 14));
  EXPECT_TRUE(attacker.waitClosed());
  EXPECT_EQ(cluster[1].agent().counters().malformedMessages, 1u);
  // Existing peers and new ones are still served.
  EXPECT_EQ(cluster[0].rpcSync<int64_t>("worker1", "add", 1, 2), 3);
  RawPeer newcomer(cluster, 1);
  auto call = callEnvelope(7, 0, "add");
  call.add_values()->set_int_value(20);
  call.add_values()->set_int_value(22);
  newcomer.send(call.SerializeAsString());
  auto reply = newcomer.nextReply();
  EXPECT_TRUE(reply.is_response());
  EXPECT_EQ(reply.id(), 7u);
  EXPECT_EQ(reply.status().code(), 0u);
  ASSERT_EQ(reply.values_size(), 1);
  EXPECT_EQ(reply.values(0).int_value(), 42);
  EXPECT_TRUE(cluster.shutdownAll());
}

// Note [Compact envelopes] in rpc/wire/compact_envelope.h: a worker reads
// both encodings, answers a flat reply compactly and an error as protobuf.
TEST(AgentInput, FlatRepliesTravelCompactlyAndBothEncodingsAreRead) {
  LocalCluster cluster(rpc::TransportKind::kInProcess, 2, nullptr, registerAdd);
  RawPeer peer(cluster, 1);
  auto call = callEnvelope(1, 0, "add");
  call.add_values()->set_int_value(20);
  call.add_values()->set_int_value(22);
  peer.send(call.SerializeAsString());
  std::string compactCall;
  call.set_id(2);
  ASSERT_TRUE(rpc::detail::writeCompactEnvelope(call, &compactCall));
  peer.send(compactCall);
  // The two calls run on the pool, so their replies come in either order.
  std::set<uint64_t> answered;
  for (int i = 0; i < 2; ++i) {
    const std::string header = peer.nextReplyHeader();
    ASSERT_TRUE(rpc::detail::isCompactEnvelope(header));
    rpc::wire::Envelope reply;
    ASSERT_TRUE(rpc::detail::parseEnvelope(header, &reply));
    answered.insert(reply.id());
    ASSERT_EQ(reply.values_size(), 1);
    EXPECT_EQ(reply.values(0).int_value(), 42);
  }
  EXPECT_EQ(answered, (std::set<uint64_t>{1, 2}));
  call.set_id(3);
  call.set_body("no_such_function");
  ASSERT_TRUE(rpc::detail::writeCompactEnvelope(call, &compactCall));
  peer.send(compactCall);
  const std::string header = peer.nextReplyHeader();
  EXPECT_FALSE(rpc::detail::isCompactEnvelope(header));
  rpc::wire::Envelope error;
  ASSERT_TRUE(error.ParseFromString(header));
  EXPECT_EQ(error.id(), 3u);
  EXPECT_EQ(
      error.status().code(),
      static_cast<uint32_t>(rpc::ErrorCode::kUnknownFunction));
  EXPECT_EQ(cluster[1].agent().counters().malformedMessages, 0u);
  EXPECT_TRUE(cluster.shutdownAll());
}

TEST(AgentInput, WrongVersionIsRefused) {
  LocalCluster cluster(rpc::TransportKind::kInProcess, 2, nullptr, registerAdd);
  RawPeer peer(cluster, 1);
  auto call = callEnvelope(1, 0, "add");
  call.set_version(99);
  peer.send(call.SerializeAsString());
  EXPECT_TRUE(peer.waitClosed());
  EXPECT_TRUE(cluster.shutdownAll());
}

TEST(AgentInput, BadValuesAreAnsweredWithMalformedMessage) {
  LocalCluster cluster(rpc::TransportKind::kInProcess, 2, nullptr, registerAdd);
  RawPeer peer(cluster, 1);
  auto call = callEnvelope(3, 0, "add");
  call.add_values()->set_tensor_index(5); // there are no tensors
  peer.send(call.SerializeAsString());
  auto reply = peer.nextReply();
  EXPECT_EQ(reply.id(), 3u);
  EXPECT_EQ(
      reply.status().code(),
      static_cast<uint32_t>(ErrorCode::kMalformedMessage));
  EXPECT_NE(reply.status().message().find("tensor index"), std::string::npos)
      << reply.status().message();
  EXPECT_EQ(reply.status().worker(), "worker1");
  EXPECT_TRUE(cluster.shutdownAll());
}

TEST(AgentInput, UnknownSenderAndUnknownKindAreAnsweredNotRun) {
  LocalCluster cluster(rpc::TransportKind::kInProcess, 2, nullptr, registerAdd);
  RawPeer peer(cluster, 1);
  auto stranger = callEnvelope(4, 99, "add");
  peer.send(stranger.SerializeAsString());
  auto reply = peer.nextReply();
  EXPECT_EQ(
      reply.status().code(),
      static_cast<uint32_t>(ErrorCode::kMalformedMessage));
  EXPECT_NE(reply.status().message().find("unknown worker"), std::string::npos);
  auto oddKind = callEnvelope(5, 0, "add");
  oddKind.set_kind(1234);
  peer.send(oddKind.SerializeAsString());
  reply = peer.nextReply();
  EXPECT_EQ(
      reply.status().code(),
      static_cast<uint32_t>(ErrorCode::kUnknownFunction));
  EXPECT_EQ(cluster[1].agent().counters().requestsServed, 0u);
  EXPECT_TRUE(cluster.shutdownAll());
}

// ---- cancellation ---------------------------------------------------------

rpc::wire::Envelope cancelEnvelope(uint64_t id, uint64_t timeoutMs) {
  rpc::wire::Envelope envelope;
  envelope.set_version(rpc::detail::kWireVersion);
  envelope.set_id(id);
  envelope.set_kind(rpc::kCancelMessageKind);
  envelope.set_from_worker(0);
  envelope.set_timeout_ms(timeoutMs);
  return envelope;
}

// As after a stall: the requests carry a timeout that, counted from their
// arrival, is far off, so only the cancels that follow them can stop them.
// The cancels must overtake the queued call although the one thread is busy.
TEST(AgentCancellation, CancelsOvertakeQueuedCallsAndSilenceARunningOne) {
  std::atomic<int> started{0};
  std::atomic<int> sawCancel{0};
  LocalCluster cluster(
      rpc::TransportKind::kInProcess,
      2,
      [](int, rpc::Options& o) { o.numWorkerThreads = 1; },
      [&started, &sawCancel](int rank, rpc::Runtime& rt) {
        registerAdd(rank, rt);
        rt.functions().add("watch", [&started, &sawCancel]() {
          ++started;
          auto end = std::chrono::steady_clock::now() + 10s;
          while (std::chrono::steady_clock::now() < end) {
            if (rpc::currentRequestCancelled()) {
              ++sawCancel;
              return true;
            }
            std::this_thread::sleep_for(1ms);
          }
          return false;
        });
      });
  RawPeer peer(cluster, 1);
  auto running = callEnvelope(1, 0, "watch");
  running.set_timeout_ms(60000);
  peer.send(running.SerializeAsString());
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (started == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_EQ(started.load(), 1);
  auto queued = callEnvelope(2, 0, "watch");
  queued.set_timeout_ms(60000);
  peer.send(queued.SerializeAsString());
  // The queued call's cancel first: by the time the running handler sees
  // its own, the other one is recorded too.
  peer.send(cancelEnvelope(2, 60000).SerializeAsString());
  peer.send(cancelEnvelope(1, 60000).SerializeAsString());

  // Neither answers: the next reply is the next call's.
  auto call = callEnvelope(3, 0, "add");
  call.set_timeout_ms(60000);
  call.add_values()->set_int_value(1);
  call.add_values()->set_int_value(2);
  peer.send(call.SerializeAsString());
  auto reply = peer.nextReply();
  EXPECT_EQ(reply.id(), 3u);
  ASSERT_EQ(reply.values_size(), 1);
  EXPECT_EQ(reply.values(0).int_value(), 3);

  EXPECT_EQ(started.load(), 1) << "the queued call ran";
  EXPECT_EQ(sawCancel.load(), 1);
  auto counters = cluster[1].agent().counters();
  EXPECT_EQ(counters.requestsCancelled, 1u);
  EXPECT_EQ(counters.responsesDropped, 1u);
  EXPECT_EQ(counters.malformedMessages, 0u);
  EXPECT_TRUE(cluster.shutdownAll());
}

TEST(AgentCancellation, NoLayerMayRegisterTheCancelKind) {
  LocalCluster cluster(
      rpc::TransportKind::kInProcess,
      1,
      nullptr,
      [](int, rpc::Runtime& rt) {
        EXPECT_THROW(
            rt.agent().registerHandler(
                rpc::kCancelMessageKind,
                "mine",
                [](rpc::Request&&) {
                  return c10::make_intrusive<c10::ivalue::Future>(
                      c10::AnyType::get());
                }),
            c10::Error);
      });
  EXPECT_TRUE(cluster.shutdownAll());
}

// ---- extension points -----------------------------------------------------

constexpr uint32_t kTestKind = 100;

c10::intrusive_ptr<c10::ivalue::Future> noHandler(rpc::Request&&) {
  return c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
}

TEST(AgentExtensions, AnUpperLayerRegistersItsOwnMessageKind) {
  LocalCluster cluster(
      rpc::TransportKind::kInProcess,
      2,
      nullptr,
      [](int, rpc::Runtime& rt) {
        rt.agent().registerHandler(
            kTestKind,
            "test.kind",
            [](rpc::Request&& r) {
              auto f =
                  c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
              f->markCompleted(c10::ivalue::Tuple::create(
                  {c10::IValue(r.body),
                   c10::IValue(r.from.name),
                   c10::IValue(r.values.at(0).toTensor() * 2)}));
              return f;
            });
        EXPECT_THROW(
            rt.agent().registerHandler(kTestKind, "again", noHandler),
            c10::Error);
      });
  rpc::OutgoingRequest request;
  request.kind = kTestKind;
  request.body = "payload";
  request.values = {at::ones({2})};
  request.what = "test.kind";
  request.timeout = 10s;
  auto future = cluster[0].agent().send("worker1", std::move(request));
  future->waitAndThrow();
  auto tuple = future->value().toTuple();
  EXPECT_EQ(tuple->elements()[0].toStringRef(), "payload");
  EXPECT_EQ(tuple->elements()[1].toStringRef(), "worker0");
  EXPECT_TRUE(at::equal(tuple->elements()[2].toTensor(), at::full({2}, 2.0)));
  // Registration closes at start().
  EXPECT_THROW(
      cluster[0].agent().registerHandler(kTestKind + 1, "late", noHandler),
      c10::Error);
  EXPECT_TRUE(cluster.shutdownAll());
}

TEST(AgentExtensions, HooksSeeTensorsAttachMetadataAndMayReplaceTensors) {
  std::mutex mutex;
  std::vector<std::string> seen; // metadata received, per message
  LocalCluster cluster(
      rpc::TransportKind::kInProcess,
      2,
      nullptr,
      [&](int, rpc::Runtime& rt) {
        rt.functions().add("echo", [](at::Tensor t) { return t; });
        rpc::MessageHook hook;
        hook.name = "test.hook";
        hook.onSend = [](const rpc::HookContext& context,
                         const std::vector<at::Tensor>& tensors,
                         std::string* metadata) {
          *metadata = (context.isResponse ? "response:" : "request:") +
              std::to_string(tensors.size()) +
              (tensors.empty()                  ? ""
                   : tensors[0].requires_grad() ? ":grad"
                                                : "");
        };
        hook.onReceive = [&](const rpc::HookContext&,
                             std::vector<at::Tensor>& tensors,
                             const std::string* metadata) {
          {
            std::lock_guard<std::mutex> guard(mutex);
            seen.push_back(metadata ? *metadata : "none");
          }
          for (auto& t : tensors) {
            t = t + 100;
          }
        };
        rt.agent().addHook(hook);
        EXPECT_THROW(rt.agent().addHook(hook), c10::Error); // same name
      });
  // The hook sees the caller's own tensor (requires_grad intact), and each
  // receiving side adds 100.
  auto x = at::ones({2}).set_requires_grad(true);
  auto y = cluster[0].rpcSync<at::Tensor>("worker1", "echo", x);
  EXPECT_TRUE(at::equal(y, at::full({2}, 201.0)));
  std::lock_guard<std::mutex> guard(mutex);
  EXPECT_EQ(
      seen,
      std::vector<std::string>({"request:1:grad", "response:1:grad"}));
}

// The request a handler serves is current on its thread and in the
// continuations it chains; the response's hook sees it too.
TEST(AgentExtensions, HandlersAndTheirContinuationsSeeTheRequestScope) {
  std::mutex mutex;
  std::vector<std::string> answeredFor; // per response: the request's tag
  LocalCluster cluster(
      rpc::TransportKind::kInProcess,
      2,
      nullptr,
      [&](int, rpc::Runtime& rt) {
        auto tagOf = []() -> std::string {
          const auto& scope = rpc::currentRequestScope();
          if (!scope) {
            return "none";
          }
          auto it = scope->metadata.find("test.scope");
          return it == scope->metadata.end() ? "none" : it->second;
        };
        rt.functions().add("tag", tagOf);
        rt.functions().add("tag_later", [&rt, tagOf]() {
          return rt.rpcAsync<std::string>("worker0", "tag")
              .then([tagOf](std::string) { return tagOf(); });
        });
        rpc::MessageHook hook;
        hook.name = "test.scope";
        hook.onSend = [&](const rpc::HookContext& context,
                          const std::vector<at::Tensor>&,
                          std::string* metadata) {
          if (!context.isResponse) {
            *metadata = "call" + std::to_string(context.messageId);
            return;
          }
          std::lock_guard<std::mutex> guard(mutex);
          answeredFor.push_back(
              context.request ? context.request->metadata.at("test.scope")
                              : "none");
        };
        rt.agent().addHook(hook);
      });
  EXPECT_FALSE(rpc::currentRequestScope());
  auto tag = cluster[0].rpcSync<std::string>("worker1", "tag");
  EXPECT_EQ(tag.rfind("call", 0), 0u) << tag;
  // The continuation runs after a nested call, still in the first request.
  auto later = cluster[0].rpcSync<std::string>("worker1", "tag_later");
  EXPECT_EQ(later.rfind("call", 0), 0u) << later;
  std::lock_guard<std::mutex> guard(mutex);
  ASSERT_EQ(answeredFor.size(), 3u);
  EXPECT_EQ(answeredFor[0], tag);
  EXPECT_EQ(answeredFor[2], later);
}

struct Blob : torch::CustomClassHolder {
  explicit Blob(std::string text) : text(std::move(text)) {}
  std::string text;
};

TEST(AgentExtensions, ValueExtensionsCarryKindsTheCodecDoesNotKnow) {
  auto extension = []() {
    rpc::ValueExtension ext;
    ext.kind = "test.blob";
    ext.matches = [](const c10::IValue& v) { return v.isCapsule(); };
    ext.encode = [](const c10::IValue& v,
                    int64_t,
                    std::string* payload,
                    std::vector<c10::IValue>* nested) {
      auto blob = c10::static_intrusive_pointer_cast<Blob>(v.toCapsule());
      *payload = blob->text;
      nested->push_back(at::arange(3)); // a tensor inside, out of band
    };
    ext.decode = [](int64_t from,
                    const std::string& payload,
                    std::vector<c10::IValue>&& nested) {
      auto text = payload + " from " + std::to_string(from) + " with " +
          std::to_string(nested.at(0).toTensor().sum().item<int64_t>());
      return c10::IValue::make_capsule(c10::make_intrusive<Blob>(text));
    };
    return ext;
  };
  LocalCluster cluster(
      rpc::TransportKind::kInProcess,
      2,
      nullptr,
      [&](int, rpc::Runtime& rt) {
        rt.agent().addValueExtension(extension());
        EXPECT_THROW(rt.agent().addValueExtension(extension()), c10::Error);
        rt.functions().add("read", [](c10::IValue v) {
          return c10::static_intrusive_pointer_cast<Blob>(v.toCapsule())->text;
        });
      });
  auto blob = c10::IValue::make_capsule(c10::make_intrusive<Blob>("hi"));
  EXPECT_EQ(
      cluster[0].rpcSync<std::string>("worker1", "read", blob),
      "hi from 0 with 3");
  EXPECT_THROW(cluster[0].agent().addValueExtension(extension()), c10::Error)
      << "registration must close at start()";
  EXPECT_TRUE(cluster.shutdownAll());
}

} // namespace
} // namespace torchrpc
