// Tier 1: the message codec of Note [Wire format] (rpc/wire/envelope.h)
// without any transport. Worker 0 encodes, worker 1 parses and decodes, as
// they would across a connection.

#include "torchrpc/rpc/wire/envelope.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

#include "proto/rpc/envelope.pb.h"
#include "tests/support/wire_tensors.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/wire/compact_envelope.h"
#include "torchrpc/rpc/wire/value_codec.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace {

using harness::asWireTensors;
using namespace std::chrono_literals;

const WorkerInfo kCaller{"worker0", 0};
const WorkerInfo kCallee{"worker1", 1};

// A message after the trip: its parsed envelope and delivered tensors.
struct Received {
  wire::Envelope envelope;
  std::vector<at::Tensor> tensors;
};

Received deliver(const MessageCodec& receiver, const Message& sent) {
  Received received;
  receiver.parse(sent.header, &received.envelope);
  received.tensors = asWireTensors(sent.tensors);
  return received;
}

c10::intrusive_ptr<c10::ivalue::Future> completedWith(c10::IValue value) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  future->markCompleted(std::move(value));
  return future;
}

c10::intrusive_ptr<c10::ivalue::Future> failedWith(std::exception_ptr error) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  future->setError(std::move(error));
  return future;
}

// Runs `fn`, which must throw RpcError; returns it.
template <typename F>
RpcError rpcErrorOf(F&& fn) {
  try {
    fn();
  } catch (const RpcError& e) {
    return e;
  }
  ADD_FAILURE() << "no RpcError thrown";
  return RpcError(ErrorCode::kOk, "", "", 0, "");
}

RpcError asRpcError(const std::exception_ptr& error) {
  return rpcErrorOf([&]() { std::rethrow_exception(error); });
}

OutgoingRequest request(std::vector<c10::IValue> values) {
  OutgoingRequest out;
  out.kind = 17;
  out.body = "scale";
  out.what = "scale";
  out.values = std::move(values);
  return out;
}

class EnvelopeCodec : public ::testing::Test {
 protected:
  // The callee answers request `id` (kind 17) with `value`.
  Received respond(uint64_t id, c10::IValue value) {
    return deliver(
        caller_,
        callee_.encodeResponse(
            kCaller,
            id,
            17,
            *completedWith(std::move(value)),
            "f",
            nullptr,
            nullptr));
  }

  Options options_;
  MessageCodec caller_{kCaller, options_};
  MessageCodec callee_{kCallee, options_};
};

TEST_F(EnvelopeCodec, RequestRoundTripsHeaderBodyAndValues) {
  auto x = at::randn({3, 4});
  auto view = at::arange(10, at::kLong).slice(0, 2, 7);
  auto outgoing = request({x, std::string("two"), int64_t(3), view});
  outgoing.timeout = 250ms;
  auto received =
      deliver(callee_, caller_.encodeRequest(kCallee, 42, outgoing, nullptr));
  const auto& envelope = received.envelope;
  EXPECT_EQ(envelope.version(), kWireVersion);
  EXPECT_EQ(envelope.id(), 42u);
  EXPECT_EQ(envelope.kind(), 17u);
  EXPECT_FALSE(envelope.is_response());
  EXPECT_EQ(envelope.from_worker(), 0);
  EXPECT_EQ(envelope.timeout_ms(), 250u);

  auto decoded =
      callee_.decodeRequest(kCaller, envelope, std::move(received.tensors));
  EXPECT_EQ(decoded.request.from, kCaller);
  EXPECT_EQ(decoded.request.id, 42u);
  EXPECT_EQ(decoded.request.kind, 17u);
  EXPECT_EQ(decoded.request.body, "scale");
  ASSERT_EQ(decoded.request.values.size(), 4u);
  EXPECT_TRUE(at::equal(decoded.request.values[0].toTensor(), x));
  EXPECT_EQ(decoded.request.values[1].toStringRef(), "two");
  EXPECT_EQ(decoded.request.values[2].toInt(), 3);
  EXPECT_TRUE(at::equal(decoded.request.values[3].toTensor(), view));
  EXPECT_EQ(decoded.scope, nullptr); // no hook attached metadata
}

// Headers are the envelopes the agent built by hand before the codec
// existed, field for field: compact when they fit (Note [Compact envelopes]
// in rpc/wire/compact_envelope.h), protobuf's encoding otherwise.
TEST_F(EnvelopeCodec, HeadersAreUnchangedOnTheWire) {
  auto outgoing = request({int64_t(7)});
  outgoing.timeout = 5ms;
  auto sent = caller_.encodeRequest(kCallee, 9, outgoing, nullptr);
  wire::Envelope expected;
  expected.set_version(kWireVersion);
  expected.set_id(9);
  expected.set_kind(17);
  expected.set_from_worker(0);
  expected.set_timeout_ms(5);
  expected.set_body("scale");
  expected.add_values()->set_int_value(7);
  std::string compact;
  ASSERT_TRUE(writeCompactEnvelope(expected, &compact));
  EXPECT_EQ(sent.header, compact);
  EXPECT_TRUE(sent.tensors.empty());

  auto failed = callee_.encodeError(
      9,
      17,
      makeRpcError(ErrorCode::kTimeout, "", "", 0, "late"),
      "scale");
  wire::Envelope expectedError;
  expectedError.set_version(kWireVersion);
  expectedError.set_id(9);
  expectedError.set_kind(17);
  expectedError.set_is_response(true);
  expectedError.set_from_worker(1);
  auto* status = expectedError.mutable_status();
  status->set_code(static_cast<uint32_t>(ErrorCode::kTimeout));
  status->set_message("late");
  status->set_worker("worker1");
  status->set_function("scale");
  EXPECT_EQ(failed.header, expectedError.SerializeAsString());
}

TEST_F(EnvelopeCodec, ResponseRoundTripsItsValue) {
  auto y = at::randn({2, 5}, at::kDouble).requires_grad_(true);
  auto received = respond(42, y);
  EXPECT_TRUE(received.envelope.is_response());
  EXPECT_EQ(received.envelope.id(), 42u);
  EXPECT_EQ(received.envelope.kind(), 17u);
  EXPECT_EQ(received.envelope.from_worker(), 1);
  EXPECT_FALSE(
      MessageCodec::statusToError(received.envelope, "worker1", "scale"));
  auto value = caller_.decodeResponse(
      kCallee,
      received.envelope,
      std::move(received.tensors));
  ASSERT_TRUE(value.isTensor());
  EXPECT_TRUE(at::equal(value.toTensor(), y));
  EXPECT_TRUE(value.toTensor().requires_grad());
}

TEST_F(EnvelopeCodec, ResponseOfNoneDecodesToNone) {
  auto received = respond(1, c10::IValue());
  EXPECT_TRUE(caller_
                  .decodeResponse(
                      kCallee,
                      received.envelope,
                      std::move(received.tensors))
                  .isNone());
}

TEST_F(EnvelopeCodec, EveryErrorCodeRoundTripsExactly) {
  for (uint32_t raw = 1; raw <= static_cast<uint32_t>(ErrorCode::kInternal);
       ++raw) {
    auto code = static_cast<ErrorCode>(raw);
    SCOPED_TRACE(errorCodeName(code));
    std::string detail = std::string("because ") + errorCodeName(code);
    auto done = failedWith(makeRpcError(code, "worker7", "inner", 0, detail));
    auto received = deliver(
        caller_,
        callee_.encodeResponse(
            kCaller,
            100 + raw,
            17,
            *done,
            "outer",
            nullptr,
            nullptr));
    EXPECT_TRUE(received.envelope.is_response());
    EXPECT_EQ(received.envelope.values_size(), 0);
    auto error = asRpcError(
        MessageCodec::statusToError(received.envelope, "worker1", "scale"));
    EXPECT_EQ(error.code(), code);
    EXPECT_EQ(error.worker(), "worker7");
    EXPECT_EQ(error.function(), "inner");
    EXPECT_EQ(error.detail(), detail);
    EXPECT_EQ(error.messageId(), 100 + raw);
  }
}

TEST_F(EnvelopeCodec, ErrorsNameTheCalleeAndOperationUnlessTheySayOtherwise) {
  auto received = deliver(
      caller_,
      callee_.encodeError(
          5,
          17,
          makeRpcError(ErrorCode::kBadArguments, "", "", 0, "wrong"),
          "scale"));
  auto error = asRpcError(
      MessageCodec::statusToError(received.envelope, "peer", "what"));
  EXPECT_EQ(error.code(), ErrorCode::kBadArguments);
  EXPECT_EQ(error.worker(), "worker1");
  EXPECT_EQ(error.function(), "scale");
  EXPECT_EQ(error.detail(), "wrong");

  // Anything but an RpcError is the remote function's exception.
  received = deliver(
      caller_,
      callee_.encodeError(
          6,
          17,
          std::make_exception_ptr(std::runtime_error("boom")),
          "scale"));
  error = asRpcError(
      MessageCodec::statusToError(received.envelope, "peer", "what"));
  EXPECT_EQ(error.code(), ErrorCode::kRemoteException);
  EXPECT_EQ(error.worker(), "worker1");
  EXPECT_EQ(error.function(), "scale");
  EXPECT_NE(error.detail().find("boom"), std::string::npos);
}

TEST_F(EnvelopeCodec, UnknownStatusCodeBecomesRemoteException) {
  wire::Envelope response;
  response.set_id(3);
  response.set_is_response(true);
  response.mutable_status()->set_code(42);
  response.mutable_status()->set_message("from a newer peer");
  auto error =
      asRpcError(MessageCodec::statusToError(response, "worker1", "scale"));
  EXPECT_EQ(error.code(), ErrorCode::kRemoteException);
  EXPECT_EQ(error.worker(), "worker1"); // the status named none
  EXPECT_EQ(error.function(), "scale");
  EXPECT_EQ(error.detail(), "from a newer peer");
  EXPECT_EQ(error.messageId(), 3u);
}

TEST_F(EnvelopeCodec, ValueThatCannotBeSentBecomesTheErrorStatus) {
  auto received = respond(8, at::Tensor());
  EXPECT_EQ(received.envelope.values_size(), 0);
  auto error = asRpcError(
      MessageCodec::statusToError(received.envelope, "worker1", "f"));
  EXPECT_EQ(error.code(), ErrorCode::kBadArguments);
  EXPECT_NE(error.detail().find("undefined tensor"), std::string::npos);
}

TEST_F(EnvelopeCodec, ValueExtensionsAreTheCodecs) {
  ValueExtension extension;
  // Stands in for an RRef: a kind the value codec does not know.
  extension.kind = "stream";
  extension.matches = [](const c10::IValue& value) { return value.isStream(); };
  extension.encode = [](const c10::IValue& value,
                        int64_t toWorker,
                        std::string* payload,
                        std::vector<c10::IValue>*) {
    *payload = "stream@" + std::to_string(toWorker);
  };
  extension.decode = [](int64_t fromWorker,
                        const std::string& payload,
                        std::vector<c10::IValue>&&) {
    return c10::IValue(payload + "<-" + std::to_string(fromWorker));
  };
  caller_.addValueExtension(extension);
  callee_.addValueExtension(extension);
  auto received = deliver(
      callee_,
      caller_.encodeRequest(
          kCallee,
          1,
          request({c10::Stream(c10::Stream::DEFAULT, c10::Device(c10::kCPU))}),
          nullptr));
  auto decoded = callee_.decodeRequest(
      kCaller,
      received.envelope,
      std::move(received.tensors));
  ASSERT_EQ(decoded.request.values.size(), 1u);
  EXPECT_EQ(decoded.request.values[0].toStringRef(), "stream@1<-0");
  EXPECT_THROW(caller_.addValueExtension(extension), c10::Error);
}

TEST_F(EnvelopeCodec, HooksCarryMetadataBothWays) {
  std::vector<std::string> seen;
  const RequestScope* scopeSeenBySend = nullptr;
  MessageHook hook;
  hook.name = "trace";
  hook.onSend = [&scopeSeenBySend](
                    const HookContext& context,
                    const std::vector<at::Tensor>& tensors,
                    std::string* metadata) {
    scopeSeenBySend = context.request;
    *metadata = (context.isResponse ? "response " : "request ") +
        std::to_string(context.messageId) + " to " + context.peer.name +
        " with " + std::to_string(tensors.size()) + " tensors";
  };
  hook.onReceive = [&seen](
                       const HookContext& context,
                       std::vector<at::Tensor>& tensors,
                       const std::string* metadata) {
    seen.push_back(
        (metadata ? *metadata : std::string("none")) + " from " +
        context.peer.name + " kind " + std::to_string(context.kind));
  };
  caller_.addHook(hook);
  callee_.addHook(hook);
  EXPECT_THROW(callee_.addHook(hook), c10::Error);

  auto x = at::ones({2});
  auto received = deliver(
      callee_,
      caller_.encodeRequest(kCallee, 4, request({x, x}), nullptr));
  auto decoded = callee_.decodeRequest(
      kCaller,
      received.envelope,
      std::move(received.tensors));
  ASSERT_NE(decoded.scope, nullptr);
  EXPECT_EQ(decoded.scope->from, kCaller);
  EXPECT_EQ(decoded.scope->messageId, 4u);
  EXPECT_EQ(decoded.scope->kind, 17u);
  EXPECT_EQ(
      decoded.scope->metadata.at("trace"),
      "request 4 to worker1 with 2 tensors");

  auto response = deliver(
      caller_,
      callee_.encodeResponse(
          kCaller,
          4,
          17,
          *completedWith(x),
          "scale",
          nullptr,
          decoded.scope.get()));
  EXPECT_EQ(scopeSeenBySend, decoded.scope.get());
  caller_.decodeResponse(
      kCallee,
      response.envelope,
      std::move(response.tensors));
  EXPECT_EQ(
      seen,
      (std::vector<std::string>{
          "request 4 to worker1 with 2 tensors from worker0 kind 17",
          "response 4 to worker0 with 1 tensors from worker1 kind 17"}));
}

TEST_F(EnvelopeCodec, ReceiveHookMustKeepTheTensorCount) {
  MessageHook hook;
  hook.name = "greedy";
  hook.onReceive = [](const HookContext&,
                      std::vector<at::Tensor>& tensors,
                      const std::string*) { tensors.push_back(at::ones({1})); };
  callee_.addHook(hook);
  auto received = deliver(
      callee_,
      caller_.encodeRequest(kCallee, 1, request({at::ones({1})}), nullptr));
  EXPECT_THROW(
      callee_.decodeRequest(
          kCaller,
          received.envelope,
          std::move(received.tensors)),
      c10::Error);
}

TEST(EnvelopeCaps, TooManyTensorsIsRefusedNamingTheCap) {
  Options options;
  options.maxTensorsPerMessage = 2;
  MessageCodec codec(kCaller, options);
  auto x = at::ones({1});
  auto error = rpcErrorOf([&]() {
    codec.encodeRequest(kCallee, 1, request({x, x, x}), nullptr);
  });
  EXPECT_EQ(error.code(), ErrorCode::kTooLarge);
  EXPECT_NE(
      error.detail().find("has 3 tensors, the cap is 2"),
      std::string::npos)
      << error.detail();
  // Two are fine.
  EXPECT_EQ(
      codec.encodeRequest(kCallee, 2, request({x, x}), nullptr).tensors.size(),
      2u);
}

TEST(EnvelopeCaps, TooManyBytesIsRefusedNamingTheCap) {
  Options options;
  options.maxMessageBytes = 1000;
  MessageCodec codec(kCaller, options);
  auto error = rpcErrorOf([&]() {
    codec.encodeRequest(
        kCallee,
        1,
        request({at::zeros({2000}, at::kByte)}),
        nullptr);
  });
  EXPECT_EQ(error.code(), ErrorCode::kTooLarge);
  EXPECT_NE(error.detail().find("the cap (1000 bytes"), std::string::npos)
      << error.detail();
}

TEST(EnvelopeCaps, TooLargeHeaderIsRefusedNamingTheCap) {
  Options options;
  options.maxHeaderBytes = 100;
  MessageCodec codec(kCaller, options);
  auto outgoing = request({});
  outgoing.body = std::string(200, 'b');
  auto error =
      rpcErrorOf([&]() { codec.encodeRequest(kCallee, 1, outgoing, nullptr); });
  EXPECT_EQ(error.code(), ErrorCode::kTooLarge);
  EXPECT_NE(error.detail().find("header 100)"), std::string::npos)
      << error.detail();

  // A response over a cap is answered with the error instead.
  MessageCodec callee(kCallee, options);
  Options roomy;
  MessageCodec caller(kCaller, roomy);
  auto received = deliver(
      caller,
      callee.encodeResponse(
          kCaller,
          3,
          17,
          *completedWith(std::string(200, 'v')),
          "f",
          nullptr,
          nullptr));
  EXPECT_EQ(
      asRpcError(MessageCodec::statusToError(received.envelope, "w", "f"))
          .code(),
      ErrorCode::kTooLarge);
}

// Note [Compact envelopes]: the compact layout spends 8 bytes a dimension
// where protobuf spends one; a header that fits the cap only as protobuf
// goes as protobuf rather than being refused.
TEST(EnvelopeCaps, AHeaderOverTheCapOnlyCompactlyGoesAsProtobuf) {
  Options options;
  options.maxHeaderBytes = 150;
  MessageCodec sender(kCaller, options);
  MessageCodec receiver(kCallee, options);
  auto x = at::arange(3, at::kFloat)
               .reshape({1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3});
  auto outgoing = request({x});
  outgoing.body = "f";
  auto sent = sender.encodeRequest(kCallee, 1, outgoing, nullptr);
  EXPECT_FALSE(isCompactEnvelope(sent.header));
  EXPECT_LE(sent.header.size(), 150u);
  auto received = deliver(receiver, sent);
  auto decoded = receiver.decodeRequest(
      kCaller,
      received.envelope,
      std::move(received.tensors));
  ASSERT_EQ(decoded.request.values.size(), 1u);
  EXPECT_TRUE(decoded.request.values[0].toTensor().equal(x));
  // Without the dimensions, the same call fits compactly.
  outgoing = request({at::arange(3, at::kFloat)});
  outgoing.body = "f";
  EXPECT_TRUE(isCompactEnvelope(
      sender.encodeRequest(kCallee, 2, outgoing, nullptr).header));
}

TEST(EnvelopeCaps, ReceivedHeaderOverTheCapIsMalformed) {
  Options options;
  options.maxHeaderBytes = 100;
  MessageCodec receiver(kCallee, options);
  Options roomy;
  MessageCodec sender(kCaller, roomy);
  auto outgoing = request({});
  outgoing.body = std::string(200, 'b');
  auto sent = sender.encodeRequest(kCallee, 1, outgoing, nullptr);
  wire::Envelope envelope;
  auto error = rpcErrorOf([&]() { receiver.parse(sent.header, &envelope); });
  EXPECT_EQ(error.code(), ErrorCode::kMalformedMessage);
  EXPECT_NE(
      error.detail().find("exceeds the cap of 100 bytes"),
      std::string::npos)
      << error.detail();
}

TEST_F(EnvelopeCodec, MalformedEnvelopesAreRefusedWithReasons) {
  wire::Envelope envelope;
  auto garbage = rpcErrorOf([&]() {
    callee_.parse(std::string("\xff\xff\xff garbage \x01", 14), &envelope);
  });
  EXPECT_EQ(garbage.code(), ErrorCode::kMalformedMessage);
  EXPECT_EQ(garbage.detail(), "header is not an envelope");

  wire::Envelope future;
  future.set_version(kWireVersion + 1);
  auto version = rpcErrorOf(
      [&]() { callee_.parse(future.SerializeAsString(), &envelope); });
  EXPECT_EQ(version.code(), ErrorCode::kMalformedMessage);
  EXPECT_EQ(version.detail(), "wire version 3, this worker speaks 2");

  // Parses, but its values point at a tensor that is not there.
  wire::Envelope dangling;
  dangling.set_version(kWireVersion);
  dangling.add_values()->set_tensor_index(5);
  callee_.parse(dangling.SerializeAsString(), &envelope);
  auto values =
      rpcErrorOf([&]() { callee_.decodeRequest(kCaller, envelope, {}); });
  EXPECT_EQ(values.code(), ErrorCode::kMalformedMessage);
  EXPECT_NE(values.detail().find("tensor index 5"), std::string::npos)
      << values.detail();

  wire::Envelope twoValues;
  twoValues.set_version(kWireVersion);
  twoValues.set_is_response(true);
  twoValues.add_values()->set_int_value(1);
  twoValues.add_values()->set_int_value(2);
  callee_.parse(twoValues.SerializeAsString(), &envelope);
  auto response =
      rpcErrorOf([&]() { callee_.decodeResponse(kCaller, envelope, {}); });
  EXPECT_EQ(response.code(), ErrorCode::kMalformedMessage);
  EXPECT_EQ(response.detail(), "a response carries at most one value");
}

TEST_F(EnvelopeCodec, SummaryNamesKindDirectionAndId) {
  auto sent = caller_.encodeRequest(kCallee, 77, request({}), nullptr);
  auto summary = summarizeMessage(sent);
  ASSERT_TRUE(summary.has_value());
  EXPECT_EQ(summary->kind, 17u);
  EXPECT_FALSE(summary->isResponse);
  EXPECT_EQ(summary->id, 77u);
  auto reply = callee_.encodeError(
      77,
      17,
      makeRpcError(ErrorCode::kTimeout, "", "", 0, "late"),
      "f");
  EXPECT_TRUE(summarizeMessage(reply)->isResponse);
  Message garbage;
  garbage.header = std::string("\xff\xff\xff", 3);
  EXPECT_FALSE(summarizeMessage(garbage).has_value());
}

// Protobuf's own nesting limit (100) is below what the codec accepts: the
// deepest value it allows travels through parse(), and one level more is
// refused there as malformed.
TEST_F(EnvelopeCodec, TheDeepestValueAllowedParsesAndOneMoreLevelIsRefused) {
  auto nested = [](int levels) {
    c10::IValue inner = int64_t(7);
    for (int i = 0; i < levels; ++i) {
      c10::impl::GenericList list(c10::unshapedType(inner.type()));
      list.push_back(std::move(inner));
      inner = c10::IValue(std::move(list));
    }
    return inner;
  };
  auto deepest = nested(kMaxValueDepth - 1);
  auto received = deliver(
      callee_,
      caller_.encodeRequest(kCallee, 5, request({deepest}), nullptr));
  auto decoded = callee_.decodeRequest(
      kCaller,
      received.envelope,
      std::move(received.tensors));
  ASSERT_EQ(decoded.request.values.size(), 1u);
  EXPECT_TRUE(decoded.request.values[0] == deepest);

  // Built by hand: the encoder refuses to send it.
  wire::Envelope tooDeep;
  tooDeep.set_version(kWireVersion);
  wire::Value* level = tooDeep.add_values();
  for (int i = 0; i < 4 * kMaxValueDepth + 8; ++i) {
    level = level->mutable_list()->add_elements();
  }
  level->set_int_value(7);
  wire::Envelope parsed;
  auto error = rpcErrorOf(
      [&]() { callee_.parse(tooDeep.SerializeAsString(), &parsed); });
  EXPECT_EQ(error.code(), ErrorCode::kMalformedMessage);
  EXPECT_NE(error.detail().find("not an envelope"), std::string::npos)
      << error.detail();
}

} // namespace
} // namespace detail
} // namespace rpc
} // namespace torchrpc
