#include "torchrpc/rpc/wire/envelope.h"

#include <google/protobuf/io/coded_stream.h>

#include <c10/util/Exception.h>

#include <limits>
#include <utility>

#include "proto/rpc/envelope.pb.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/wire/compact_envelope.h"
#include "torchrpc/rpc/wire/recycled_envelope.h"
#include "torchrpc/rpc/wire/value_codec.h"

namespace torchrpc {
namespace rpc {

std::optional<MessageSummary> summarizeMessage(const Message& message) {
  wire::Envelope envelope;
  if (!detail::parseEnvelope(message.header, &envelope)) {
    return std::nullopt;
  }
  MessageSummary summary;
  summary.kind = envelope.kind();
  summary.isResponse = envelope.is_response();
  summary.id = envelope.id();
  return summary;
}

namespace detail {

namespace {

// Registration is closed once the agent listens (the agent checks that);
// names must be unique.
template <typename T>
void addUnique(
    std::vector<T>& entries,
    T entry,
    std::string T::*key,
    const char* what) {
  for (const auto& existing : entries) {
    TORCH_CHECK(
        existing.*key != entry.*key,
        "a ",
        what,
        " named '",
        entry.*key,
        "' is already added");
  }
  entries.push_back(std::move(entry));
}

[[noreturn]] void throwMalformed(const std::string& detail) {
  throw RpcError(ErrorCode::kMalformedMessage, "", "", 0, detail);
}

} // namespace

std::string serializeEnvelope(const wire::Envelope& envelope) {
  std::string bytes;
  if (!writeCompactEnvelope(envelope, &bytes)) {
    envelope.SerializeToString(&bytes);
  }
  return bytes;
}

bool parseEnvelope(const std::string& bytes, wire::Envelope* envelope) {
  if (isCompactEnvelope(bytes)) {
    envelope->Clear();
    return readCompactEnvelope(bytes.data(), bytes.size(), envelope);
  }
  if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return false;
  }
  // Protobuf's flat-array parse costs less (no stream to set up), but its
  // nesting limit (100) is below what the codec accepts; what it refuses is
  // parsed again with the codec's limit, at most twice the work of a header
  // within its cap.
  if (envelope->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return true;
  }
  google::protobuf::io::CodedInputStream input(
      reinterpret_cast<const uint8_t*>(bytes.data()),
      static_cast<int>(bytes.size()));
  input.SetRecursionLimit(4 * kMaxValueDepth + 8);
  return envelope->ParseFromCodedStream(&input) &&
      input.ConsumedEntireMessage();
}

MessageCodec::MessageCodec(WorkerInfo self, const Options& options)
    : self_(std::move(self)),
      maxMessageBytes_(options.maxMessageBytes),
      maxHeaderBytes_(options.maxHeaderBytes),
      maxTensorsPerMessage_(options.maxTensorsPerMessage) {}

void MessageCodec::addHook(MessageHook hook) {
  addUnique(hooks_, std::move(hook), &MessageHook::name, "hook");
}

void MessageCodec::addValueExtension(ValueExtension extension) {
  addUnique(
      extensions_,
      std::move(extension),
      &ValueExtension::kind,
      "value extension");
}

// ---- sending ---------------------------------------------------------------

void MessageCodec::startEnvelope(
    wire::Envelope& envelope,
    uint64_t id,
    uint32_t kind,
    bool isResponse) const {
  envelope.set_version(kWireVersion);
  envelope.set_id(id);
  envelope.set_kind(kind);
  envelope.set_is_response(isResponse);
  envelope.set_from_worker(self_.id);
}

Message MessageCodec::encodeRequest(
    const WorkerInfo& to,
    uint64_t id,
    const OutgoingRequest& request,
    const DeviceMap* deviceMap,
    bool traced) const {
  RecycledEnvelope envelope = takeEnvelope();
  startEnvelope(*envelope, id, request.kind, /*isResponse=*/false);
  envelope->set_timeout_ms(request.timeout.count());
  envelope->set_traced(traced);
  envelope->set_body(request.body);
  return encodeValues(*envelope, to, request.values, deviceMap, nullptr);
}

Message MessageCodec::encodeResponse(
    const WorkerInfo& to,
    uint64_t id,
    uint32_t kind,
    const c10::ivalue::Future& done,
    const std::string& what,
    const DeviceMap* deviceMap,
    const RequestScope* request) const {
  if (done.hasError()) {
    return encodeError(id, kind, done.exception_ptr(), what);
  }
  try {
    RecycledEnvelope envelope = takeEnvelope();
    startEnvelope(*envelope, id, kind, /*isResponse=*/true);
    return encodeValues(*envelope, to, done.constValue(), deviceMap, request);
  } catch (...) {
    return encodeError(id, kind, std::current_exception(), what);
  }
}

Message MessageCodec::encodeCancel(
    uint64_t id,
    std::chrono::milliseconds timeout) const {
  RecycledEnvelope envelope = takeEnvelope();
  startEnvelope(*envelope, id, kCancelMessageKind, /*isResponse=*/false);
  envelope->set_timeout_ms(timeout.count());
  Message message;
  message.header = serializeEnvelope(*envelope);
  return message;
}

Message MessageCodec::encodeHeartbeat(bool isResponse) const {
  RecycledEnvelope envelope = takeEnvelope();
  startEnvelope(*envelope, 0, kHeartbeatMessageKind, isResponse);
  Message message;
  message.header = serializeEnvelope(*envelope);
  return message;
}

Message MessageCodec::encodeError(
    uint64_t id,
    uint32_t kind,
    const std::exception_ptr& error,
    const std::string& what) const {
  RecycledEnvelope envelope = takeEnvelope();
  startEnvelope(*envelope, id, kind, /*isResponse=*/true);
  errorToStatus(error, what, envelope->mutable_status());
  Message message;
  message.header = serializeEnvelope(*envelope);
  return message;
}

Message MessageCodec::encodeValues(
    wire::Envelope& envelope,
    const WorkerInfo& to,
    c10::ArrayRef<c10::IValue> values,
    const DeviceMap* deviceMap,
    const RequestScope* request) const {
  ValueEncoder encoder(to.id, deviceMap, &extensions_);
  encoder.reuseDescriptorsOf(&envelope);
  for (const auto& value : values) {
    encoder.encode(value, envelope.add_values());
  }
  Message message;
  std::vector<at::Tensor> originals;
  if (!hooks_.empty()) {
    originals = encoder.originalTensors();
  }
  message.tensors = std::move(encoder).finish(&envelope);
  if (!hooks_.empty()) {
    HookContext context{
        to,
        envelope.kind(),
        envelope.id(),
        envelope.is_response(),
        request};
    for (const auto& hook : hooks_) {
      if (!hook.onSend) {
        continue;
      }
      std::string metadata;
      hook.onSend(context, originals, &metadata);
      if (!metadata.empty()) {
        (*envelope.mutable_metadata())[hook.name] = std::move(metadata);
      }
    }
  }
  size_t total = 0;
  for (const auto& tensor : message.tensors) {
    total += tensor.nbytes();
  }
  if (message.tensors.size() > maxTensorsPerMessage_) {
    throw RpcError(
        ErrorCode::kTooLarge,
        "",
        "",
        0,
        "message has " + std::to_string(message.tensors.size()) +
            " tensors, the cap is " + std::to_string(maxTensorsPerMessage_));
  }
  message.header = serializeEnvelope(envelope);
  if (message.header.size() > maxHeaderBytes_ &&
      isCompactEnvelope(message.header)) {
    // Compact fields are wider than protobuf's varints (Note [Compact
    // envelopes]); at the cap, the narrower encoding decides.
    message.header = envelope.SerializeAsString();
  }
  total += message.header.size();
  if (message.header.size() > maxHeaderBytes_ || total > maxMessageBytes_) {
    throw RpcError(
        ErrorCode::kTooLarge,
        "",
        "",
        0,
        "message of " + std::to_string(total) + " bytes exceeds the cap (" +
            std::to_string(maxMessageBytes_) + " bytes, header " +
            std::to_string(maxHeaderBytes_) + ")");
  }
  return message;
}

// ---- receiving -------------------------------------------------------------

void MessageCodec::parse(const std::string& header, wire::Envelope* envelope)
    const {
  if (header.size() > maxHeaderBytes_) {
    throwMalformed(
        "header of " + std::to_string(header.size()) +
        " bytes exceeds the cap of " + std::to_string(maxHeaderBytes_) +
        " bytes");
  }
  if (!parseEnvelope(header, envelope)) {
    throwMalformed("header is not an envelope");
  }
  if (envelope->version() != kWireVersion) {
    throwMalformed(
        "wire version " + std::to_string(envelope->version()) +
        ", this worker speaks " + std::to_string(kWireVersion));
  }
}

std::vector<c10::IValue> MessageCodec::decodeValues(
    const WorkerInfo& from,
    const wire::Envelope& envelope,
    std::vector<at::Tensor>&& tensors) const {
  ValueDecoder decoder(from.id, envelope, std::move(tensors), &extensions_);
  if (!hooks_.empty()) {
    HookContext context{
        from,
        envelope.kind(),
        envelope.id(),
        envelope.is_response(),
        nullptr};
    size_t count = decoder.tensors().size();
    for (const auto& hook : hooks_) {
      if (!hook.onReceive) {
        continue;
      }
      auto it = envelope.metadata().find(hook.name);
      hook.onReceive(
          context,
          decoder.tensors(),
          it == envelope.metadata().end() ? nullptr : &it->second);
      TORCH_CHECK(
          decoder.tensors().size() == count,
          "hook '",
          hook.name,
          "' changed the number of tensors");
    }
  }
  std::vector<c10::IValue> values;
  values.reserve(envelope.values_size());
  for (const auto& value : envelope.values()) {
    values.push_back(decoder.decode(value));
  }
  return values;
}

DecodedRequest MessageCodec::decodeRequest(
    const WorkerInfo& from,
    const wire::Envelope& envelope,
    std::vector<at::Tensor>&& tensors) const {
  DecodedRequest decoded;
  decoded.request.from = from;
  decoded.request.id = envelope.id();
  decoded.request.kind = envelope.kind();
  decoded.request.values = decodeValues(from, envelope, std::move(tensors));
  decoded.request.body = envelope.body();
  if (envelope.metadata_size() > 0) {
    auto scope = std::make_shared<RequestScope>();
    scope->from = from;
    scope->messageId = envelope.id();
    scope->kind = envelope.kind();
    scope->metadata.insert(
        envelope.metadata().begin(),
        envelope.metadata().end());
    decoded.scope = std::move(scope);
  }
  return decoded;
}

c10::IValue MessageCodec::decodeResponse(
    const WorkerInfo& from,
    const wire::Envelope& envelope,
    std::vector<at::Tensor>&& tensors) const {
  auto values = decodeValues(from, envelope, std::move(tensors));
  if (values.size() > 1) {
    throwMalformed("a response carries at most one value");
  }
  return values.empty() ? c10::IValue() : std::move(values[0]);
}

// ---- status <-> RpcError ---------------------------------------------------

void MessageCodec::errorToStatus(
    const std::exception_ptr& error,
    const std::string& what,
    wire::Status* status) const {
  try {
    std::rethrow_exception(error);
  } catch (const RpcError& e) {
    status->set_code(static_cast<uint32_t>(e.code()));
    status->set_message(e.detail());
    status->set_worker(e.worker().empty() ? self_.name : e.worker());
    status->set_function(e.function().empty() ? what : e.function());
    return;
  } catch (...) {
  }
  status->set_code(static_cast<uint32_t>(ErrorCode::kRemoteException));
  status->set_message(describeException(error));
  status->set_worker(self_.name);
  status->set_function(what);
}

std::exception_ptr MessageCodec::statusToError(
    const wire::Envelope& response,
    const std::string& worker,
    const std::string& function) {
  const auto& status = response.status();
  if (status.code() == 0) {
    return nullptr;
  }
  auto code = static_cast<ErrorCode>(status.code());
  if (status.code() > static_cast<uint32_t>(ErrorCode::kInternal)) {
    code = ErrorCode::kRemoteException;
  }
  return makeRpcError(
      code,
      status.worker().empty() ? worker : status.worker(),
      status.function().empty() ? function : status.function(),
      response.id(),
      status.message());
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
