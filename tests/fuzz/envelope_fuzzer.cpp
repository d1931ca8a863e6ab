// libFuzzer target: a received message as the agent handles it (Note [Wire
// format]): MessageCodec::parse, then for a response its status and value,
// for a request its values and metadata. Guarantee 3 of the note: anything
// either decodes or is refused with RpcError(kMalformedMessage); any other
// exception, crash, leak or over-cap allocation is a finding.
//
// Input: a transport message, as tests/fuzz/fuzz_message.h reads it.

#include <c10/util/Exception.h>
#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "proto/rpc/envelope.pb.h"
#include "tests/fuzz/fuzz_message.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/wire/envelope.h"

using namespace torchrpc::rpc;

namespace {

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "envelope_fuzzer: %s\n", what);
  std::abort();
}

const torchrpc::rpc::detail::MessageCodec& codec() {
  // A worker's defaults: the caps it runs with in production.
  static const torchrpc::rpc::detail::MessageCodec codec(
      WorkerInfo{"fuzz", 0},
      Options());
  return codec;
}

void receive(Message&& message) {
  const WorkerInfo peer{"peer", 1};
  summarizeMessage(message);
  wire::Envelope envelope;
  codec().parse(message.header, &envelope);
  if (envelope.is_response()) {
    if (auto error = torchrpc::rpc::detail::MessageCodec::statusToError(
            envelope,
            "peer",
            "call")) {
      try {
        std::rethrow_exception(error);
      } catch (const RpcError& e) {
        return; // what the caller's future fails with
      } catch (...) {
        finding("statusToError made something other than an RpcError");
      }
    }
    codec().decodeResponse(peer, envelope, std::move(message.tensors));
    return;
  }
  codec().decodeRequest(peer, envelope, std::move(message.tensors));
}

} // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  // Invalid UTF-8 in a string field is refused, and logged: keep the
  // fuzzer's output readable.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    receive(fuzz::messageFromBytes(data, size));
  } catch (const RpcError& e) {
    if (e.code() != ErrorCode::kMalformedMessage) {
      std::fprintf(stderr, "%s\n", e.what());
      finding("refused with a code other than kMalformedMessage");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    finding("decoding threw something other than RpcError");
  }
  return 0;
}
