#include "clock_alignment.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <sstream>
#include <utility>

namespace torchrpc {
namespace trace {

namespace {

// x[to] - x[from] <= weight
struct Constraint {
  std::size_t from;
  std::size_t to;
  double weight;
};

// Groups of workers linked by exchanged calls.
class Components {
 public:
  explicit Components(std::size_t n) : parent_(n) {
    std::iota(parent_.begin(), parent_.end(), 0);
  }

  std::size_t find(std::size_t x) {
    while (parent_[x] != x) {
      parent_[x] = parent_[parent_[x]];
      x = parent_[x];
    }
    return x;
  }

  // Keeps the lower index as the root, so each group's root is its
  // lowest-rank worker.
  bool unite(std::size_t a, std::size_t b) {
    a = find(a);
    b = find(b);
    if (a == b) {
      return false;
    }
    parent_[std::max(a, b)] = std::min(a, b);
    return true;
  }

 private:
  std::vector<std::size_t> parent_;
};

std::map<std::pair<std::size_t, std::size_t>, PairClock> collectPairs(
    const std::vector<Exchange>& exchanges) {
  std::map<std::pair<std::size_t, std::size_t>, PairClock> pairs;
  for (const auto& x : exchanges) {
    if (x.caller == x.callee) {
      continue; // a worker calling itself says nothing about clocks
    }
    std::size_t a = std::min(x.caller, x.callee);
    std::size_t b = std::max(x.caller, x.callee);
    // theta of this call is o_callee - o_caller; flip it into o_b - o_a.
    double sign = x.caller == a ? 1.0 : -1.0;
    PairClock& pair = pairs[{a, b}];
    pair.a = a;
    pair.b = b;
    ++pair.calls;
    auto bound = [&pair, &x](double callLo, double callHi) {
      // callLo <= theta_call <= callHi, in pair orientation.
      if (callLo > pair.lo) {
        pair.lo = callLo;
        pair.loCall = x.call;
      }
      if (callHi < pair.hi) {
        pair.hi = callHi;
        pair.hiCall = x.call;
      }
    };
    const double inf = std::numeric_limits<double>::infinity();
    // Request: theta_call <= t2 - t1.
    double upper = x.tRecv - x.tSend;
    if (sign > 0) {
      bound(-inf, upper);
    } else {
      bound(-upper, inf);
    }
    if (x.tSendReply && x.tReply) {
      // Reply: theta_call >= t3 - t4.
      double lower = *x.tSendReply - *x.tReply;
      if (sign > 0) {
        bound(lower, inf);
      } else {
        bound(-inf, -lower);
      }
      double theta = ((x.tRecv - x.tSend) + (lower)) / 2;
      double delay = (*x.tReply - x.tSend) - (*x.tSendReply - x.tRecv);
      ++pair.samples;
      if (!pair.minDelay || delay < *pair.minDelay) {
        pair.minDelay = delay;
        pair.estimate = sign * theta;
      }
    }
  }
  return pairs;
}

// The estimate for a pair without a sample: inside its bounds.
double boundedGuess(const PairClock& pair) {
  if (pair.estimate) {
    return *pair.estimate;
  }
  if (std::isfinite(pair.lo) && std::isfinite(pair.hi)) {
    return (pair.lo + pair.hi) / 2;
  }
  return std::isfinite(pair.hi) ? pair.hi : pair.lo;
}

// Bellman-Ford from `x`: `down` gives the greatest solution <= x, else the
// least >= x. False when it does not settle (a negative cycle).
bool relax(
    std::vector<double>& x,
    const std::vector<Constraint>& constraints,
    bool down) {
  for (std::size_t pass = 0; pass <= x.size() + 1; ++pass) {
    bool changed = false;
    for (const auto& c : constraints) {
      if (down) {
        if (x[c.from] + c.weight < x[c.to] - kRelaxationSlackUs) {
          x[c.to] = x[c.from] + c.weight;
          changed = true;
        }
      } else if (x[c.to] - c.weight > x[c.from] + kRelaxationSlackUs) {
        x[c.from] = x[c.to] - c.weight;
        changed = true;
      }
    }
    if (!changed) {
      return true;
    }
  }
  return false;
}

std::string formatUs(double us) {
  std::ostringstream out;
  out.setf(std::ios::fixed);
  out.precision(3);
  out << us << " us";
  return out.str();
}

} // namespace

Alignment alignClocks(
    const std::vector<std::string>& workerNames,
    const std::vector<Exchange>& exchanges) {
  const std::size_t workers = workerNames.size();
  Alignment result;
  result.offsets.assign(workers, 0.0);
  result.connected.assign(workers, false);
  auto pairMap = collectPairs(exchanges);
  for (auto& [key, pair] : pairMap) {
    result.pairs.push_back(pair);
  }

  // Step 3: least-delay spanning forest (Kruskal); pairs with no sample
  // come last.
  std::vector<std::size_t> order(result.pairs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(
      order.begin(),
      order.end(),
      [&result](std::size_t l, std::size_t r) {
        const auto& a = result.pairs[l];
        const auto& b = result.pairs[r];
        if (a.minDelay.has_value() != b.minDelay.has_value()) {
          return a.minDelay.has_value();
        }
        return a.minDelay && *a.minDelay < *b.minDelay;
      });
  Components components(workers);
  std::vector<std::vector<std::pair<std::size_t, double>>> tree(workers);
  for (std::size_t i : order) {
    auto& pair = result.pairs[i];
    if (components.unite(pair.a, pair.b)) {
      pair.inTree = true;
      double theta = boundedGuess(pair);
      tree[pair.a].push_back({pair.b, theta});
      tree[pair.b].push_back({pair.a, -theta});
    }
  }
  std::vector<double> estimate(workers, 0.0);
  std::vector<bool> placed(workers, false);
  for (std::size_t root = 0; root < workers; ++root) {
    if (placed[root]) {
      continue;
    }
    // Roots come in index order, so this is the group's lowest worker.
    std::vector<std::size_t> stack{root};
    placed[root] = true;
    while (!stack.empty()) {
      std::size_t w = stack.back();
      stack.pop_back();
      for (auto [next, theta] : tree[w]) {
        if (!placed[next]) {
          placed[next] = true;
          estimate[next] = estimate[w] + theta;
          stack.push_back(next);
        }
      }
    }
  }
  for (std::size_t w = 0; w < workers; ++w) {
    result.connected[w] = components.find(w) == components.find(0);
  }

  // Step 4.
  std::vector<Constraint> constraints;
  for (const auto& pair : result.pairs) {
    if (std::isfinite(pair.hi)) {
      constraints.push_back({pair.a, pair.b, pair.hi});
    }
    if (std::isfinite(pair.lo)) {
      constraints.push_back({pair.b, pair.a, -pair.lo});
    }
    if (pair.lo > pair.hi + kRelaxationSlackUs) {
      result.conflicts.push_back(
          workerNames[pair.a] + " <-> " + workerNames[pair.b] + ": call " +
          pair.loCall + " needs " + workerNames[pair.b] +
          "'s clock to be at least " + formatUs(pair.lo) + " ahead of " +
          workerNames[pair.a] + "'s, call " + pair.hiCall + " at most " +
          formatUs(pair.hi));
    }
  }
  std::vector<double> upper = estimate;
  std::vector<double> lower = estimate;
  result.feasible = result.conflicts.empty() &&
      relax(upper, constraints, /*down=*/true) &&
      relax(lower, constraints, /*down=*/false);
  std::vector<double> offsets = estimate;
  if (result.feasible) {
    for (std::size_t w = 0; w < workers; ++w) {
      offsets[w] = (upper[w] + lower[w]) / 2;
    }
  }
  // Each group keeps its lowest worker's clock.
  for (std::size_t w = 0; w < workers; ++w) {
    result.offsets[w] = offsets[w] - offsets[components.find(w)];
  }
  return result;
}

} // namespace trace
} // namespace torchrpc
