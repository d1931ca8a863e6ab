// How fast this machine runs right now, for bench/compare to print beside
// every workload. A virtual machine's speed can change from one second to
// the next (the host's other load); bench/RESULTS.md records this one's
// two speeds. A figure can only be compared with another measured at the
// same speed.
//
//   BUILD_DIR/bench/machine_speed [--quick]
//
// Times libtorch's x + 1 on a one-element float tensor, the computation of
// the call workloads, alone in a loop on this thread: 2,000 warm-up
// operations, then chunks of 100 ms (10, or 3 with --quick), each timed
// operation by operation. Prints each chunk's median on stderr and one JSON
// line on stdout whose value is the median of the chunks' medians; "min"
// and "max" are the fastest and slowest chunk, so a run that straddled a
// change of speed shows it. Exit 1 if x + 1 gives a wrong answer.

#include "bench/bench_support.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <vector>

namespace {

using torchrpc::bench::Clock;

// The median time of one x + 1 over `chunk` of timed operations (at least
// one, even when the thread lost its CPU for the whole chunk).
double chunkMedian(const at::Tensor& x, std::chrono::milliseconds chunk) {
  std::vector<double> micros;
  micros.reserve(200000);
  const auto start = Clock::now();
  do {
    const auto before = Clock::now();
    at::Tensor y = x + 1;
    micros.push_back(torchrpc::bench::microsSince(before));
  } while (Clock::now() - start < chunk && micros.size() < 200000);
  return torchrpc::bench::median(micros);
}

} // namespace

int main(int argc, char** argv) {
  const bool quick =
      torchrpc::bench::parseQuickOnly("machine_speed", argc, argv);
  at::Tensor x = at::ones({1});
  at::Tensor check = x + 1;
  if (check.item<float>() != 2.0f) {
    std::cerr << "machine_speed: x + 1 gave " << check.item<float>() << "\n";
    return 1;
  }
  for (int i = 0; i < 2000; ++i) {
    at::Tensor y = x + 1;
  }
  const int chunks = quick ? 3 : 10;
  std::vector<double> medians;
  for (int i = 0; i < chunks; ++i) {
    medians.push_back(chunkMedian(x, std::chrono::milliseconds(100)));
  }
  std::cerr << "machine_speed: x + 1 per 100 ms chunk (us):";
  for (double m : medians) {
    std::cerr << " " << m;
  }
  std::cerr << "\n";
  const auto [low, high] = std::minmax_element(medians.begin(), medians.end());
  std::printf(
      "{\"workload\": \"machine_speed\", \"metric\": \"x_plus_one\", "
      "\"unit\": \"us\", \"value\": %.3f, \"better\": \"lower\", \"min\": "
      "%.3f, \"max\": %.3f}\n",
      torchrpc::bench::median(medians),
      *low,
      *high);
  return 0;
}
