#pragma once

// dist_autograd_overhead's definition (bench/README.md), in one place for
// the two programs that measure it: torchrpc_bench (through torchrpc) and
// autograd_limit (through one bare socket, the machine's bound). The model,
// the local training it is compared with, the alternation of local and
// distributed iterations whose neighbouring differences make the figure, and
// the timing of each iteration's phases, which says where a difference
// comes from.

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <iterator>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_support.h"

namespace torchrpc {
namespace bench {

// torch.manual_seed(0); Sequential of 4 Linear(1024, 1024), as on the
// PyTorch side.
torch::nn::Sequential makeSplitTrainingModel();

// The learning rate of both sides' SGD (no momentum).
constexpr double kSplitTrainingLearningRate = 0.01;

// The training in one process that a distributed iteration is compared
// with: zero_grad(set_to_none=True), model(x).sum().backward(), SGD step.
class LocalTraining {
 public:
  LocalTraining();

  // The workload's input: at::rand({1, 1024}), drawn right after the
  // model, so the same on every side.
  const at::Tensor& input() const {
    return x_;
  }
  torch::nn::Sequential& model() {
    return model_;
  }

  // One iteration; `phase(name)`, when given, is called at the end of each
  // of "local forward", "local backward" and "local step".
  void iterate(const std::function<void(const char*)>& phase = {});

  // The last iteration's model output (detached): what a distributed
  // forward with the same number of steps behind it must give. (With no
  // activation between the layers the summed output has no minimum: after
  // about five steps almost every parameter, and so the output, is NaN.)
  const at::Tensor& lastOutput() const {
    return lastOutput_;
  }

 private:
  torch::nn::Sequential model_;
  torch::optim::SGD sgd_;
  at::Tensor x_;
  at::Tensor lastOutput_;
};

// The durations of named phases of repeated iterations: start() marks an
// iteration's start, end(name) closes the phase that ran since the last
// mark. print() writes each phase's median, in first-seen order. Names are
// literals, compared without building a string inside the timed code.
class Phases {
 public:
  void start() {
    mark_ = Clock::now();
  }
  void end(const char* name) {
    auto now = Clock::now();
    auto it = std::find_if(phases_.begin(), phases_.end(), [&](const auto& p) {
      return p.first == name;
    });
    if (it == phases_.end()) {
      phases_.emplace_back(name, std::vector<double>());
      it = std::prev(phases_.end());
    }
    it->second.push_back(
        std::chrono::duration<double, std::micro>(now - mark_).count());
    mark_ = now;
  }
  void clear() {
    phases_.clear();
  }
  void print(std::ostream& out) const {
    out << "phases, median us:";
    for (const auto& p : phases_) {
      out << " " << p.first << " " << median(p.second) << ";";
    }
    out << "\n";
  }

 private:
  Clock::time_point mark_;
  std::vector<std::pair<std::string, std::vector<double>>> phases_;
};

// Local and distributed iterations alternate (the distributed side's
// workers idle, without spinning, during the local ones): 20 pairs of
// warm-up (5 with `quick`), then `afterWarmUp`, then 200 timed pairs (40).
// Returns the median of the pairs' differences (distributed - local, µs),
// which cancels the machine's slow drifts that a difference of two ~15 ms
// medians does not; prints both sides' medians and minimums on stderr.
double medianSplitTrainingOverhead(
    const std::function<void()>& localIteration,
    const std::function<void()>& distributedIteration,
    bool quick,
    const std::function<void()>& afterWarmUp = {});

} // namespace bench
} // namespace torchrpc
