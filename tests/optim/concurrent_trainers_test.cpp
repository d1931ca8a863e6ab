// Tier 2: trainers stepping concurrently on shared remote parameters (a
// parameter RRef and a RemoteModule on one parameter server), as in
// PyTorch's parameter-server tutorial, which crashes with two trainers
// ("modified by an inplace operation"). Here: no autograd error, no lost
// update (step counts, and the final value is the start minus every applied
// gradient), and every gradient is the one its own forward's parameter
// values give (Note [Parameters updated while backward passes are pending]).

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tests/support/local_cluster.h"
#include "tests/support/split_model.h"
#include "torchrpc/autograd/context.h"
#include "torchrpc/autograd/context_container.h"
#include "torchrpc/nn/remote_module.h"
#include "torchrpc/optim/distributed_optimizer.h"

namespace torchrpc {
namespace testing {
namespace {

constexpr double kLr = 0.01;

// On the server: x * w * w with the values it used, and the gradient of a
// parameter in a context, summed over the versions the context used.
void addServerFunctions(rpc::Runtime& runtime) {
  runtime.functions().add(
      "w_square",
      [](rref::RRef<at::Tensor> w, at::Tensor x) {
        at::Tensor used = w.localValue();
        return std::make_tuple(x * used * used, used.detach().clone());
      });
  auto container = autograd::ContextContainer::of(runtime);
  std::weak_ptr<autograd::ContextContainer> weak = container;
  runtime.functions().add(
      "gradient_of",
      [weak](rref::RRef<at::Tensor> w, int64_t contextId) {
        auto layer = weak.lock();
        auto& versions = layer->parameterVersions();
        auto context = layer->find(contextId);
        TORCH_CHECK(context, "no context ", contextId);
        int64_t slot = versions.find(w.localValue());
        auto bySlot = versions.bySlot(context->gradients());
        auto it = bySlot.find(slot);
        TORCH_CHECK(it != bySlot.end(), "no gradient for w");
        return it->second;
      });
}

// What the server hands its trainers: the parameters and the module.
struct Shared {
  std::vector<rref::RRef<at::Tensor>> parameters; // the module's, then W
  std::vector<nn::RemoteModule<torch::nn::Linear>> module;
};

class ConcurrentTrainersTest : public ::testing::TestWithParam<int> {};

TEST_P(ConcurrentTrainersTest, EveryStepCountsAndEveryGradientIsItsOwn) {
  const int trainers = GetParam();
  const int steps = 400 / trainers;
  auto shared = std::make_shared<Shared>();
  LocalCluster cluster(
      rpc::TransportKind::kInProcess,
      trainers + 1,
      nullptr,
      [shared](int rank, rpc::Runtime& runtime) {
        split::installLayers(runtime);
        if (rank == 0) {
          addServerFunctions(runtime);
          runtime.functions().add("shared_parameters", [shared]() {
            return shared->parameters;
          });
          runtime.functions().add("shared_module", [shared]() {
            return shared->module.at(0);
          });
        }
      });
  auto w = rref::remote<at::Tensor>(cluster[0], "worker0", "make_w");
  auto fc = nn::RemoteModule<torch::nn::Linear>::withTypeName(
      cluster[0],
      "worker0",
      split::kLinearType,
      int64_t(4),
      int64_t(3));
  shared->parameters = fc.remoteParameters();
  shared->parameters.push_back(w);
  shared->module.push_back(fc);
  const at::Tensor w0 = w.toHere();

  std::vector<at::Tensor> applied(trainers);
  std::vector<std::vector<int64_t>> counts(trainers);
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < trainers; ++t) {
    threads.emplace_back([&, t]() {
      auto& rt = cluster[t + 1];
      try {
        // Handles passed to this trainer's worker by the server.
        auto params = rt.rpcSync<std::vector<rref::RRef<at::Tensor>>>(
            "worker0",
            "shared_parameters");
        auto myFc = rt.rpcSync<nn::RemoteModule<torch::nn::Linear>>(
            "worker0",
            "shared_module");
        auto myW = params.at(2);
        optim::DistributedOptimizer optimizer(
            rt,
            params,
            torch::optim::SGDOptions(kLr));
        at::Tensor sum = at::zeros_like(w0);
        for (int step = 0; step < steps; ++step) {
          at::Tensor x = at::sin(at::arange(6, at::kFloat) * (t + 1) + step)
                             .reshape({3, 2});
          autograd::Context context(rt);
          auto out = rt.rpcSync<std::tuple<at::Tensor, at::Tensor>>(
              "worker0",
              "w_square",
              myW,
              x);
          at::Tensor h = myFc.forward(split::input(step + 100 * t));
          context.backward({std::get<0>(out).sum() + h.pow(2).mean()});
          at::Tensor gradient = rt.rpcSync<at::Tensor>(
              "worker0",
              "gradient_of",
              myW,
              context.id());
          at::Tensor expected = 2 * x * std::get<1>(out);
          if (!at::equal(gradient, expected)) {
            ADD_FAILURE() << "trainer " << t << " step " << step
                          << ": the gradient is not its forward's";
            ++failures;
          }
          optimizer.step(context.id());
          sum += gradient;
        }
        applied[t] = sum;
        counts[t] = optimizer.stepCounts();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "trainer " << t << ": " << e.what();
        ++failures;
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  ASSERT_EQ(failures.load(), 0);
  at::Tensor expected = w0.clone();
  for (int t = 0; t < trainers; ++t) {
    // One owner (the server) holds every parameter; each of its steps ran.
    EXPECT_EQ(counts[t], std::vector<int64_t>{steps}) << "trainer " << t;
    expected -= kLr * applied[t];
  }
  // A lost update would leave kLr * |gradient| (~1e-2) between them; the
  // tolerance only covers the order of the float additions.
  at::Tensor final = w.toHere();
  EXPECT_TRUE(at::allclose(final, expected, 1e-5, 1e-5))
      << "differs by " << (final - expected).abs().max().item<double>();
  EXPECT_FALSE(at::allclose(final, w0, 1e-3, 1e-3));
  shared->parameters.clear();
  shared->module.clear();
  EXPECT_TRUE(cluster.shutdownAll());
}

INSTANTIATE_TEST_SUITE_P(
    Trainers,
    ConcurrentTrainersTest,
    ::testing::Values(2, 4),
    [](const ::testing::TestParamInfo<int>& info) {
      return std::to_string(info.param) + "Trainers";
    });

} // namespace
} // namespace testing
} // namespace torchrpc
