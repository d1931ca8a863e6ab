#pragma once

// A small model split over three workers, and the same model in one process,
// for the nn/ and optim/ suites: worker1 owns a RemoteModule (a Linear 4->3),
// worker2 owns a plain parameter RRef W (3x2) used through a registered
// function, worker0 drives. Every value is deterministic (no RNG), so each
// process of a tier-3 test can compute the one-process reference itself.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "torchrpc/autograd/context.h"
#include "torchrpc/autograd/context_container.h"
#include "torchrpc/nn/module_registry.h"
#include "torchrpc/nn/remote_module.h"
#include "torchrpc/optim/distributed_optimizer.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rref/rref.h"
#include "torchrpc/rref/rref_context.h"

namespace torchrpc {
namespace testing {
namespace split {

constexpr const char* kLinearType = "test.DeterministicLinear";

inline at::Tensor initialWeight() {
  return at::sin(at::arange(12, at::kFloat)).reshape({3, 4}) * 0.5;
}
inline at::Tensor initialBias() {
  return at::cos(at::arange(3, at::kFloat)) * 0.1;
}
inline at::Tensor initialW() {
  return at::cos(at::arange(6, at::kFloat) * 0.7).reshape({3, 2});
}
// The batch of step `step`.
inline at::Tensor input(int64_t step) {
  return at::sin(at::arange(32, at::kFloat) * 0.37 + step).reshape({8, 4});
}
inline at::Tensor target(int64_t step) {
  return at::cos(at::arange(16, at::kFloat) * 0.21 - step).reshape({8, 2});
}

inline torch::nn::Linear deterministicLinear(int64_t in, int64_t out) {
  torch::nn::Linear linear(in, out);
  at::NoGradGuard noGrad;
  linear->weight.copy_(initialWeight());
  linear->bias.copy_(initialBias());
  return linear;
}

// Every layer and function the model needs, on a bare rpc::Runtime (before
// start()). torchrpc::Runtime already has the layers; call addFunctions.
inline void addFunctions(rpc::Runtime& runtime) {
  nn::registerModuleFactory<torch::nn::Linear>(
      runtime,
      kLinearType,
      [](int64_t in, int64_t out) { return deterministicLinear(in, out); });
  nn::registerModule<torch::nn::Linear, int64_t, int64_t>(runtime);
  runtime.functions().add("make_w", []() {
    return initialW().requires_grad_();
  });
  runtime.functions().add("make_ones", [](int64_t n) {
    return at::ones({n}).requires_grad_();
  });
  // Reads the parameter's current value at each call, as a forward must.
  runtime.functions().add(
      "w_matmul",
      [](rref::RRef<at::Tensor> w, at::Tensor x) {
        return x.matmul(w.localValue());
      });
}
inline void installLayers(rpc::Runtime& runtime) {
  rref::RRefContext::install(runtime);
  autograd::ContextContainer::install(runtime);
  optim::installOwnerSide(runtime);
  addFunctions(runtime);
}

// The distributed model, driven from one worker.
struct DistributedModel {
  explicit DistributedModel(rpc::Runtime& runtime)
      : runtime(runtime),
        fc(nn::RemoteModule<torch::nn::Linear>::withTypeName(
            runtime,
            "worker1/cpu",
            kLinearType,
            int64_t(4),
            int64_t(3))),
        w(rref::remote<at::Tensor>(runtime, "worker2", "make_w")) {}

  at::Tensor loss(int64_t step) const {
    at::Tensor h = at::relu(fc.forward(input(step)));
    at::Tensor y = runtime.rpcSync<at::Tensor>("worker2", "w_matmul", w, h);
    return (y - target(step)).pow(2).mean();
  }
  std::vector<rref::RRef<at::Tensor>> parameters() const {
    auto out = fc.remoteParameters();
    out.push_back(w);
    return out;
  }
  // weight, bias, W: the values now.
  std::vector<at::Tensor> values() const {
    auto state = fc.stateDict();
    return {state.at("weight"), state.at("bias"), w.toHere()};
  }
  // One training step in a fresh context.
  void trainStep(optim::DistributedOptimizer& optimizer, int64_t step) const {
    autograd::Context context(runtime);
    context.backward({loss(step)});
    optimizer.step(context.id());
  }

  rpc::Runtime& runtime;
  nn::RemoteModule<torch::nn::Linear> fc;
  rref::RRef<at::Tensor> w;
};

// The same model in one process.
struct LocalModel {
  LocalModel()
      : fc(deterministicLinear(4, 3)),
        w(initialW().requires_grad_()) {}

  at::Tensor loss(int64_t step) {
    at::Tensor h = at::relu(fc->forward(input(step)));
    return (h.matmul(w) - target(step)).pow(2).mean();
  }
  std::vector<at::Tensor> parameters() const {
    return {fc->weight, fc->bias, w};
  }
  std::vector<at::Tensor> values() const {
    return {fc->weight.detach(), fc->bias.detach(), w.detach()};
  }
  void trainStep(torch::optim::Optimizer& optimizer, int64_t step) {
    optimizer.zero_grad();
    loss(step).backward();
    optimizer.step();
  }

  torch::nn::Linear fc;
  at::Tensor w;
};

// Expects equal values; exact when tolerance is 0.
inline void expectSameValues(
    const std::vector<at::Tensor>& actual,
    const std::vector<at::Tensor>& expected,
    double tolerance,
    const std::string& what) {
  static const char* names[] = {"weight", "bias", "W"};
  ASSERT_EQ(actual.size(), expected.size()) << what;
  for (size_t i = 0; i < actual.size(); ++i) {
    if (tolerance == 0) {
      EXPECT_TRUE(at::equal(actual[i], expected[i]))
          << what << ": " << names[i] << " differs by "
          << (actual[i] - expected[i]).abs().max().item<double>();
    } else {
      EXPECT_TRUE(at::allclose(actual[i], expected[i], tolerance, tolerance))
          << what << ": " << names[i] << " differs by "
          << (actual[i] - expected[i]).abs().max().item<double>();
    }
  }
}

} // namespace split
} // namespace testing
} // namespace torchrpc
