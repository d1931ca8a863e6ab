#pragma once

// Private: the envelope every message travels in, and the codec that builds
// and reads it. The generated protobuf code stays out of this header (the
// tests of upper layers include it for summarizeMessage); .cpp files that
// read envelope fields include proto/rpc/envelope.pb.h themselves.

#include <ATen/core/ivalue.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torchrpc/rpc/message_hook.h"
#include "torchrpc/rpc/options.h"
#include "torchrpc/rpc/request.h"
#include "torchrpc/rpc/request_scope.h"
#include "torchrpc/rpc/transport/transport.h"
#include "torchrpc/rpc/value_extension.h"
#include "torchrpc/rpc/worker_info.h"

namespace torchrpc {
namespace rpc {

namespace wire {
class Envelope;
class Status;
} // namespace wire

// Note [Wire format]
// ~~~~~~~~~~~~~~~~~~
// Every message is one protobuf Envelope (the transport's header) plus a list
// of tensors whose bytes travel out of band. The envelope names no upper
// layer: a version, the message id (a response carries its request's), the
// kind and whether it is a response, the sending worker, a status (responses
// only), metadata written by send hooks under their names, a kind-specific
// body, the values and the tensor descriptors (proto/rpc/envelope.proto).
// MessageCodec below is the one place that fills and reads these fields.
// An envelope of flat values travels in a compact layout of its own, read
// and written without protobuf's parser and serializer (Note [Compact
// envelopes] in rpc/wire/compact_envelope.h); the fields are the same.
//
// Values are c10::IValues encoded as a `wire::Value` tree
// (rpc/wire/value_codec.h); a tensor is encoded as an index into the
// envelope's tensor descriptors. Descriptors describe the transport's
// tensors in order: a strided tensor is one of them, a sparse COO tensor two
// (Note [Sparse tensors on the wire] in rpc/wire/value_codec.h).
//
// Guarantees:
//  1. A value round-trips exactly: kind, container element types (also of
//     empty containers), tensor dtype, shape, values and requires_grad.
//  2. Only the bytes a tensor covers travel: a contiguous view sends its own
//     range, a non-contiguous tensor is compacted first.
//  3. Decoding never trusts the peer: every index, dtype, size, nesting depth
//     and byte count is checked before use, and any violation throws
//     RpcError(kMalformedMessage) without crashing or over-allocating.
//  4. Nothing is executed while decoding; extensions only rebuild values.

// What a fault injector may want to know of a message the agent sent: its
// message kind, whether it is a response, and its id. nullopt for a header
// that is not an envelope. For tests; NB: it parses the whole header.
struct MessageSummary {
  uint32_t kind = 0;
  bool isResponse = false;
  uint64_t id = 0;
};
std::optional<MessageSummary> summarizeMessage(const Message& message);

namespace detail {

// Bumped on incompatible changes of the envelope; a receiver refuses other
// versions. 2: compact envelopes.
constexpr uint32_t kWireVersion = 2;

// The bytes of an envelope: compact when it fits Note [Compact envelopes]
// (rpc/wire/compact_envelope.h), protobuf's encoding otherwise.
std::string serializeEnvelope(const wire::Envelope& envelope);

// Parses an envelope that serializeEnvelope wrote, either way. A protobuf
// envelope is parsed with a nesting limit that fits kMaxValueDepth (each
// value level takes up to four protobuf levels; protobuf's default of 100
// would refuse values the codec accepts). False if the bytes do not parse.
bool parseEnvelope(const std::string& bytes, wire::Envelope* envelope);

// A request decoded for its handler, with the scope its metadata makes
// (nullptr when the sender's hooks attached none).
struct DecodedRequest {
  Request request;
  std::shared_ptr<const RequestScope> scope;
};

// Turns requests and responses into Messages and back for one worker: owns
// the value extensions, the message hooks and the size caps. See Note [Wire
// format].
//
// Registration (addHook, addValueExtension) happens before the first message;
// afterwards the codec is read-only and every method may run on any thread
// concurrently. Hooks run on the calling thread.
class MessageCodec {
 public:
  MessageCodec(WorkerInfo self, const Options& options);

  // Throws c10::Error for a duplicate hook name or extension kind.
  void addHook(MessageHook hook);
  void addValueExtension(ValueExtension extension);

  // ---- sending -------------------------------------------------------------
  //
  // deviceMap: where the message's tensors land at `to` (nullptr: CPU only).

  // Throws RpcError: kBadArguments for a value that cannot be sent, kTooLarge
  // over a cap (the text names the cap); whatever a send hook throws passes
  // through. `traced` marks the request for tracing (Note [Tracing] in
  // rpc/tracing.h).
  Message encodeRequest(
      const WorkerInfo& to,
      uint64_t id,
      const OutgoingRequest& request,
      const DeviceMap* deviceMap,
      bool traced = false) const;

  // The response to request `id` of `kind` once its handler's future `done`
  // has completed: its value, or its error as the status (see errorToStatus;
  // `what` names the operation). A value that cannot be sent becomes the
  // error instead. `request` is the request's scope, shown to send hooks.
  // Does not throw for what `done` holds.
  Message encodeResponse(
      const WorkerInfo& to,
      uint64_t id,
      uint32_t kind,
      const c10::ivalue::Future& done,
      const std::string& what,
      const DeviceMap* deviceMap,
      const RequestScope* request) const;

  // Caller -> callee: the caller gave up on its request `id`, which had
  // `timeout` (kCancelMessageKind; Note [Cancelled requests] in agent.cpp).
  Message encodeCancel(uint64_t id, std::chrono::milliseconds timeout) const;

  // An agent heartbeat (kHeartbeatMessageKind), or its answer.
  Message encodeHeartbeat(bool isResponse) const;

  // A response carrying only an error status.
  Message encodeError(
      uint64_t id,
      uint32_t kind,
      const std::exception_ptr& error,
      const std::string& what) const;

  // ---- receiving -----------------------------------------------------------

  // Checks a received header (the header cap, protobuf, the version) and
  // parses it into *envelope. Throws RpcError(kMalformedMessage) saying
  // which check failed.
  void parse(const std::string& header, wire::Envelope* envelope) const;

  // Rebuilds a request's tensors, runs the receive hooks, decodes the values
  // and builds the handler's scope. Throws RpcError(kMalformedMessage) for
  // values that do not decode; c10::Error if a hook changes the number of
  // tensors; whatever a hook throws passes through.
  DecodedRequest decodeRequest(
      const WorkerInfo& from,
      const wire::Envelope& envelope,
      std::vector<at::Tensor>&& tensors) const;

  // The same for a successful response: its value (None if it carries
  // none). Also throws RpcError(kMalformedMessage) for more than one value.
  c10::IValue decodeResponse(
      const WorkerInfo& from,
      const wire::Envelope& envelope,
      std::vector<at::Tensor>&& tensors) const;

  // ---- status <-> RpcError -------------------------------------------------

  // Writes an error into a status: an RpcError keeps its code, detail,
  // worker and function (the last two default to this worker and `what`);
  // anything else becomes kRemoteException with its text.
  void errorToStatus(
      const std::exception_ptr& error,
      const std::string& what,
      wire::Status* status) const;

  // The inverse, for a response: nullptr if its status says success.
  // Otherwise the RpcError it carries (an unknown code becomes
  // kRemoteException); worker and function default to the given ones.
  static std::exception_ptr statusToError(
      const wire::Envelope& response,
      const std::string& worker,
      const std::string& function);

 private:
  // The one place that sets the fields every envelope carries.
  void startEnvelope(
      wire::Envelope& envelope,
      uint64_t id,
      uint32_t kind,
      bool isResponse) const;

  Message encodeValues(
      wire::Envelope& envelope,
      const WorkerInfo& to,
      c10::ArrayRef<c10::IValue> values,
      const DeviceMap* deviceMap,
      const RequestScope* request) const;

  std::vector<c10::IValue> decodeValues(
      const WorkerInfo& from,
      const wire::Envelope& envelope,
      std::vector<at::Tensor>&& tensors) const;

  const WorkerInfo self_;
  const size_t maxMessageBytes_;
  const size_t maxHeaderBytes_;
  const size_t maxTensorsPerMessage_;
  std::vector<MessageHook> hooks_;
  std::vector<ValueExtension> extensions_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
