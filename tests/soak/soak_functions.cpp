#include "tests/soak/soak_functions.h"

#include <torch/nn/modules/linear.h>

#include <utility>
#include <vector>

namespace torchrpc {
namespace soak {

void SoakState::keep(RRef<at::Tensor> rref) {
  RRef<at::Tensor> evicted;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    kept_.push_back(std::move(rref));
    if (kept_.size() > kMaxKept) {
      evicted = std::move(kept_.front());
      kept_.pop_front();
    }
  }
  // NB: dropped outside the lock: a deletion sends a message.
}

void SoakState::dropKept() {
  std::deque<RRef<at::Tensor>> dropped;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    dropped.swap(kept_);
  }
}

void addSoakFunctions(torchrpc::Runtime& rt, SoakState& state) {
  auto& f = rt.functions();
  f.add("soak.call", [&state](int64_t caller, int64_t seq, at::Tensor x) {
    state.ledger.served(caller, seq);
    return callAnswer(x, seq);
  });
  f.add("soak.fill", [](int64_t n, double base) { return filled(n, base); });
  // A fork reached this (third) worker: fetch its value asynchronously (no
  // pool thread waits) and check it; maybe keep the fork for a while.
  f.add(
      "soak.checkFork",
      [&state](RRef<at::Tensor> r, double expectedSum, bool keep) {
        if (keep) {
          state.keep(r);
        }
        return r.toHereAsync().then([expectedSum](at::Tensor value) {
          return value.sum().item<double>() == expectedSum;
        });
      });
  // The model's pieces: a Linear as a RemoteModule and a parameter W read
  // through its RRef at each use (see split_model.h in tests/support).
  nn::registerModule<torch::nn::Linear, int64_t, int64_t>(rt);
  f.add("soak.makeW", [](int64_t in, int64_t out) {
    return (at::ones({in, out}) * 0.1).requires_grad_();
  });
  f.add("soak.wMatmul", [](RRef<at::Tensor> w, at::Tensor x) {
    return x.matmul(w.localValue());
  });
  // Rank 0's barriers and the final gathering.
  f.add("soak.arrive", [&state](int64_t phase) {
    TORCH_CHECK(phase >= 0 && phase < SoakState::kPhases, "bad phase");
    state.arrived[phase]++;
  });
  f.add("soak.arrived", [&state](int64_t phase) {
    TORCH_CHECK(phase >= 0 && phase < SoakState::kPhases, "bad phase");
    return state.arrived[phase].load();
  });
  f.add("soak.report", [&state]() { return state.ledger.report(); });
}

} // namespace soak
} // namespace torchrpc
