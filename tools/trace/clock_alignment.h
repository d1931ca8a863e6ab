#pragma once

// Note [Clock alignment]
// Each worker stamps its events with its own monotonic clock. We look for
// one offset per worker, o_W = (W's clock) - (reference clock) in µs, the
// reference being worker 0 (the lowest rank), so that ts - o_W puts every
// event on the reference's timeline.
//
// 1. Samples. A call from A to B seen on both sides gives t1 = t_send and
//    t4 = t_reply on A's clock, t2 = t_recv and t3 = t_send_reply on B's.
//    When all four are known it is an NTP sample of theta = o_B - o_A:
//    theta ~ ((t2 - t1) + (t3 - t4)) / 2, off by at most half the round
//    trip delta = (t4 - t1) - (t3 - t2). Per pair of workers (calls in both
//    directions) the sample with the least delta is the estimate.
// 2. Bounds. A message is never received before it was sent, so every
//    exchanged call bounds theta whatever the delays were:
//    t3 - t4 <= theta <= t2 - t1 (the reply half only when both t3 and t4
//    are known). These are hard; estimates are not.
// 3. Estimate. A spanning tree of least-delta pairs, rooted at the lowest
//    worker of each connected group, gives one offset per worker.
// 4. Feasibility. All bounds together are a system of difference
//    constraints lo_AB <= o_B - o_A <= hi_AB. Bellman-Ford relaxation
//    started from the estimate, downward, yields the greatest solution
//    below it; upward, the least solution above it. The region is convex,
//    so their midpoint satisfies every bound; when the estimate already
//    did, both equal it and nothing moves. Relaxation that does not settle
//    within n passes means a negative cycle: no offsets satisfy every
//    call, and the estimate is kept as it is (the caller reports the
//    calls it leaves out of order).
// 5. Workers with no exchanged call linking them to the reference keep
//    their own clock (offset 0 relative to the lowest worker of their own
//    group) and are marked not connected.

#include <cstddef>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace torchrpc {
namespace trace {

// Slack allowed when relaxing, in µs: far below clock resolution, it keeps
// rounding from looking like a negative cycle.
constexpr double kRelaxationSlackUs = 1e-4;

// One call seen on both sides. Times in µs, each on its own worker's clock.
struct Exchange {
  std::size_t caller = 0;
  std::size_t callee = 0;
  std::string call;
  double tSend = 0; // t1, caller's clock
  double tRecv = 0; // t2, callee's clock
  std::optional<double> tSendReply; // t3, callee's clock
  std::optional<double> tReply; // t4, caller's clock
};

// What the calls between workers a < b say about theta = o_b - o_a.
struct PairClock {
  std::size_t a = 0;
  std::size_t b = 0;
  std::size_t calls = 0;
  std::size_t samples = 0; // calls with all four times
  std::optional<double> minDelay; // least round-trip delta of a sample
  std::optional<double> estimate; // theta of that sample
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  std::string loCall; // the call that set lo
  std::string hiCall; // the call that set hi
  bool inTree = false; // used by the spanning tree (step 3)
};

struct Alignment {
  // Per worker: its clock minus the reference clock, µs.
  std::vector<double> offsets;
  // Per worker: linked to worker 0 by exchanged calls.
  std::vector<bool> connected;
  std::vector<PairClock> pairs; // sorted by (a, b)
  // Whether the offsets satisfy every bound (step 4).
  bool feasible = true;
  // Pairs whose own calls already contradict each other (lo > hi).
  std::vector<std::string> conflicts;
};

// One worker per name (names only label conflicts); worker 0 is the
// reference. See Note [Clock alignment].
Alignment alignClocks(
    const std::vector<std::string>& workerNames,
    const std::vector<Exchange>& exchanges);

} // namespace trace
} // namespace torchrpc
