// Microbenchmarks of the per-message work on the call path that does not
// depend on the network: encoding and decoding a call's envelope.
//
//   build/bench/codec_microbench [--benchmark_filter=...]

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include "proto/rpc/envelope.pb.h"
#include "torchrpc/rpc/wire/envelope.h"
#include "torchrpc/rpc/wire/value_codec.h"

namespace {

using torchrpc::rpc::detail::ValueDecoder;
using torchrpc::rpc::detail::ValueEncoder;
namespace wire = torchrpc::rpc::wire;

std::vector<c10::IValue> callArguments(int64_t elements) {
  return {c10::IValue(at::ones({elements})), c10::IValue(2.0)};
}

void encodeCall(benchmark::State& state) {
  auto args = callArguments(state.range(0));
  for (auto _ : state) {
    wire::Envelope envelope;
    envelope.set_version(torchrpc::rpc::detail::kWireVersion);
    envelope.set_id(42);
    envelope.set_body("scale");
    ValueEncoder encoder(1, nullptr, nullptr);
    for (const auto& arg : args) {
      encoder.encode(arg, envelope.add_values());
    }
    auto tensors = std::move(encoder).finish(&envelope);
    std::string header = torchrpc::rpc::detail::serializeEnvelope(envelope);
    benchmark::DoNotOptimize(header);
    benchmark::DoNotOptimize(tensors);
  }
}
BENCHMARK(encodeCall)->Arg(1)->Arg(1 << 20);

void decodeCall(benchmark::State& state) {
  auto args = callArguments(state.range(0));
  wire::Envelope envelope;
  envelope.set_version(torchrpc::rpc::detail::kWireVersion);
  ValueEncoder encoder(1, nullptr, nullptr);
  for (const auto& arg : args) {
    encoder.encode(arg, envelope.add_values());
  }
  auto tensors = std::move(encoder).finish(&envelope);
  std::string header = torchrpc::rpc::detail::serializeEnvelope(envelope);
  std::vector<at::Tensor> wireTensors;
  for (const auto& t : tensors) {
    wireTensors.push_back(at::empty({int64_t(t.nbytes())}, at::kByte));
  }
  for (auto _ : state) {
    wire::Envelope parsed;
    torchrpc::rpc::detail::parseEnvelope(header, &parsed);
    ValueDecoder decoder(0, parsed, wireTensors, nullptr);
    for (const auto& value : parsed.values()) {
      benchmark::DoNotOptimize(decoder.decode(value));
    }
  }
}
BENCHMARK(decodeCall)->Arg(1)->Arg(1 << 20);

} // namespace

BENCHMARK_MAIN();
