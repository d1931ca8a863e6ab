// What the receive buffer pool (rpc/transport/receive_buffer_pool.h) buys a
// large incoming tensor: allocating its buffer and writing every byte, once
// with fresh memory from at::empty and once with a buffer from the pool,
// given back when the tensor dies as the transports do.
//
//   build/bench/receive_buffer_microbench [--benchmark_filter=...]
//
// bytes_per_second is the fill rate; fresh memory pays a page fault per
// page, a pooled buffer's pages are already mapped.

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <cstring>

#include "torchrpc/rpc/transport/receive_buffer_pool.h"

namespace {

using torchrpc::rpc::detail::ReceiveBufferPool;

template <typename Allocate>
void allocateAndFill(benchmark::State& state, Allocate allocate) {
  const auto nbytes = static_cast<size_t>(state.range(0));
  at::Tensor source = at::ones({state.range(0)}, at::kByte);
  for (auto _ : state) {
    at::Tensor buffer = allocate(nbytes);
    std::memcpy(buffer.data_ptr(), source.data_ptr(), nbytes);
    benchmark::DoNotOptimize(buffer.data_ptr());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(
      static_cast<int64_t>(state.iterations()) * state.range(0));
}

void freshFill(benchmark::State& state) {
  allocateAndFill(state, [](size_t nbytes) {
    return at::empty({static_cast<int64_t>(nbytes)}, at::kByte);
  });
}

void pooledFill(benchmark::State& state) {
  auto pool = ReceiveBufferPool::create();
  allocateAndFill(state, [&pool](size_t nbytes) {
    return pool->allocate(nbytes);
  });
}

// A 4 MiB and a 64 MiB tensor, in wall-clock time: what a receive waits.
void receiveSizes(benchmark::internal::Benchmark* b) {
  b->Arg(4 << 20)->Arg(64 << 20)->UseRealTime()->Unit(benchmark::kMillisecond);
}

BENCHMARK(freshFill)->Apply(receiveSizes);
BENCHMARK(pooledFill)->Apply(receiveSizes);

} // namespace

BENCHMARK_MAIN();
