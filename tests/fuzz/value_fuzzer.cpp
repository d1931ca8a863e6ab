// libFuzzer target: the value codec alone (rpc/wire/value_codec.h), with an
// upper layer's value extension registered. Whatever decodes must encode
// again (or be refused as kBadArguments, e.g. a tensor on a device this
// worker has no map for), and decoding that encoding must give the same
// encoding: the round trip of guarantee 1 of Note [Wire format].
//
// Input: a transport message, as tests/fuzz/fuzz_message.h reads it; its
// header is an Envelope whose `values` are decoded.

#include <google/protobuf/stubs/logging.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_message.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/wire/envelope.h"
#include "torchrpc/rpc/wire/value_codec.h"

using namespace torchrpc::rpc;
using namespace torchrpc::rpc::detail;

namespace {

[[noreturn]] void finding(const char* what) {
  std::fprintf(stderr, "value_fuzzer: %s\n", what);
  std::abort();
}

// Stands in for an upper layer's kind (as RRefs are): a future's value,
// refusing payloads it did not write.
const std::vector<ValueExtension>& extensions() {
  static const std::vector<ValueExtension> all = [] {
    ValueExtension box;
    box.kind = "fuzz.box";
    box.matches = [](const c10::IValue& value) { return value.isFuture(); };
    box.encode = [](const c10::IValue& value,
                    int64_t /*toWorker*/,
                    std::string* payload,
                    std::vector<c10::IValue>* nested) {
      *payload = "box";
      nested->push_back(value.toFuture()->value());
    };
    box.decode = [](int64_t /*fromWorker*/,
                    const std::string& payload,
                    std::vector<c10::IValue>&& nested) {
      if (payload != "box" || nested.size() != 1) {
        throw std::runtime_error("not a box");
      }
      auto future =
          c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
      future->markCompleted(std::move(nested[0]));
      return c10::IValue(future);
    };
    return std::vector<ValueExtension>{box};
  }();
  return all;
}

struct Encoded {
  std::string envelope; // serialized, with descriptors and values
  std::vector<at::Tensor> tensors; // as the transport delivers them
};

std::vector<c10::IValue> decodeAll(
    const wire::Envelope& envelope,
    std::vector<at::Tensor> tensors) {
  ValueDecoder decoder(1, envelope, std::move(tensors), &extensions());
  std::vector<c10::IValue> values;
  for (const auto& value : envelope.values()) {
    values.push_back(decoder.decode(value));
  }
  return values;
}

// Throws RpcError(kBadArguments) for what cannot be sent.
Encoded encodeAll(const std::vector<c10::IValue>& values) {
  ValueEncoder encoder(1, nullptr, &extensions());
  wire::Envelope envelope;
  for (const auto& value : values) {
    encoder.encode(value, envelope.add_values());
  }
  Encoded out;
  for (auto& tensor : std::move(encoder).finish(&envelope)) {
    auto bytes = at::empty({static_cast<int64_t>(tensor.nbytes())}, at::kByte);
    if (tensor.nbytes() > 0) {
      std::memcpy(bytes.data_ptr(), tensor.data_ptr(), tensor.nbytes());
    }
    out.tensors.push_back(std::move(bytes));
  }
  envelope.SerializeToString(&out.envelope);
  return out;
}

bool sameBytes(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() &&
      (a.nbytes() == 0 ||
       std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0);
}

void roundTrip(const std::vector<c10::IValue>& values) {
  Encoded first;
  try {
    first = encodeAll(values);
  } catch (const RpcError& e) {
    if (e.code() != ErrorCode::kBadArguments) {
      finding("re-encoding failed with a code other than kBadArguments");
    }
    return;
  }
  wire::Envelope envelope;
  if (!parseEnvelope(first.envelope, &envelope)) {
    finding("an encoded envelope does not parse");
  }
  std::vector<c10::IValue> again;
  try {
    again = decodeAll(envelope, first.tensors);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    finding("what the encoder wrote does not decode");
  }
  Encoded second = encodeAll(again);
  if (second.envelope != first.envelope ||
      second.tensors.size() != first.tensors.size()) {
    finding("a value does not round-trip (envelope differs)");
  }
  for (size_t i = 0; i < first.tensors.size(); ++i) {
    if (!sameBytes(first.tensors[i], second.tensors[i])) {
      finding("a value does not round-trip (tensor bytes differ)");
    }
  }
}

} // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Message message = fuzz::messageFromBytes(data, size);
  wire::Envelope envelope;
  if (!parseEnvelope(message.header, &envelope)) {
    return 0;
  }
  std::vector<c10::IValue> values;
  try {
    values = decodeAll(envelope, std::move(message.tensors));
  } catch (const RpcError& e) {
    if (e.code() != ErrorCode::kMalformedMessage) {
      finding("refused with a code other than kMalformedMessage");
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    finding("decoding threw something other than RpcError");
  }
  roundTrip(values);
  return 0;
}
