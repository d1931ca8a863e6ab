// Tier 1: FlatOptimizer (Note [One flat step per owner]) gives every
// parameter exactly what libtorch's own per-parameter optimizer gives it,
// through flat steps, steps that skip a parameter, checkpoints and learning
// rate changes, for every kind DistributedOptimizer offers.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <memory>
#include <string>
#include <vector>

#include "torchrpc/optim/detail/flat_optimizer.h"
#include "torchrpc/optim/optimizer_options.h"

namespace torchrpc {
namespace testing {
namespace {

using optim::OptimizerOptions;
using optim::detail::FlatOptimizer;

// Shapes whose sizes are no multiple of any vector width, a matrix among
// them, so that flat and per-parameter kernels split the work differently.
std::vector<at::Tensor> initialValues(at::ScalarType secondType = at::kFloat) {
  at::manual_seed(7);
  return {
      at::randn({3, 5}),
      at::randn({1}).to(secondType),
      at::randn({1031}),
      at::randn({17, 2})};
}

// The reference: libtorch's optimizer over independent tensors.
struct Reference {
  Reference(const OptimizerOptions& options, std::vector<at::Tensor> initial) {
    for (auto& value : initial) {
      parameters.push_back(value.clone());
    }
    optimizer = options.make(parameters);
  }
  void step(const std::vector<at::Tensor>& gradients) {
    at::NoGradGuard noGrad;
    for (size_t i = 0; i < parameters.size(); ++i) {
      parameters[i].mutable_grad() = gradients[i];
    }
    optimizer->step();
  }
  std::vector<at::Tensor> parameters;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
};

std::vector<at::Tensor> gradientsFor(
    const std::vector<at::Tensor>& parameters,
    int step,
    int skipped = -1) {
  at::manual_seed(100 + step);
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < parameters.size(); ++i) {
    out.push_back(
        static_cast<int>(i) == skipped ? at::Tensor()
                                       : at::randn_like(parameters[i]));
  }
  return out;
}

void expectBitwiseEqual(
    const std::vector<at::Tensor>& actual,
    const std::vector<at::Tensor>& expected,
    const std::string& when) {
  ASSERT_EQ(actual.size(), expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    EXPECT_TRUE(at::equal(actual[i], expected[i]))
        << "parameter " << i << " " << when << ": max difference "
        << (actual[i] - expected[i]).abs().max().item<double>();
  }
}

std::string saved(FlatOptimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::string bytes;
  archive.save_to([&bytes](const void* data, size_t size) {
    bytes.append(static_cast<const char*>(data), size);
    return size;
  });
  return bytes;
}

struct Kind {
  std::string name;
  OptimizerOptions options;
  bool hasStepCount;
};

class FlatOptimizerTest : public ::testing::TestWithParam<Kind> {};

// Two full steps (flat), one that skips a parameter (per parameter, as
// libtorch does), two full ones again (flat again only for SGD, whose state
// has no step count), a checkpoint restored into a fresh optimizer, a new
// learning rate: bitwise what libtorch's per-parameter optimizer computes.
TEST_P(FlatOptimizerTest, EqualsLibtorchPerParameterStepBitwise) {
  const Kind& kind = GetParam();
  auto initial = initialValues();
  FlatOptimizer flat(kind.options, initial);
  Reference reference(kind.options, initial);
  expectBitwiseEqual(flat.parameters(), reference.parameters, "at start");

  int step = 0;
  for (; step < 2; ++step) {
    auto gradients = gradientsFor(initial, step);
    EXPECT_EQ(flat.step(gradients), 4);
    reference.step(gradients);
    EXPECT_TRUE(flat.fused()) << "step " << step;
    expectBitwiseEqual(
        flat.parameters(),
        reference.parameters,
        "after flat step " + std::to_string(step));
  }

  auto partial = gradientsFor(initial, step++, /*skipped=*/1);
  EXPECT_EQ(flat.step(partial), 3);
  reference.step(partial);
  EXPECT_FALSE(flat.fused());
  expectBitwiseEqual(
      flat.parameters(),
      reference.parameters,
      "after the step that skipped parameter 1");

  for (int end = step + 2; step < end; ++step) {
    auto gradients = gradientsFor(initial, step);
    flat.step(gradients);
    reference.step(gradients);
    EXPECT_EQ(flat.fused(), !kind.hasStepCount) << "step " << step;
    expectBitwiseEqual(
        flat.parameters(),
        reference.parameters,
        "after step " + std::to_string(step));
  }

  // A checkpoint taken while fused or not restores into a fresh optimizer
  // (whose values are set as LocalOptimizer sets them: copy_).
  std::string bytes = saved(flat);
  FlatOptimizer restored(kind.options, initial);
  for (size_t i = 0; i < initial.size(); ++i) {
    restored.parameters()[i].copy_(flat.parameters()[i]);
  }
  torch::serialize::InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  restored.load(archive);
  restored.setLearningRate(restored.learningRate() / 2);
  for (auto& group : reference.optimizer->param_groups()) {
    group.options().set_lr(group.options().get_lr() / 2);
  }
  for (int end = step + 2; step < end; ++step) {
    auto gradients = gradientsFor(initial, step);
    restored.step(gradients);
    reference.step(gradients);
    expectBitwiseEqual(
        restored.parameters(),
        reference.parameters,
        "after step " + std::to_string(step) + " of the restored optimizer");
  }
  // Stepping moved the parameters: the comparisons were not of untouched
  // values.
  EXPECT_FALSE(at::equal(restored.parameters()[2], initial[2]));
}

// A checkpoint of a flat optimizer is libtorch's per-parameter one: it
// restores into a flat optimizer that then steps as libtorch's optimizer,
// never interrupted, does.
TEST_P(FlatOptimizerTest, CheckpointOfFlatStateContinuesExactly) {
  const Kind& kind = GetParam();
  auto initial = initialValues();
  FlatOptimizer original(kind.options, initial);
  Reference reference(kind.options, initial);
  for (int step = 0; step < 3; ++step) {
    auto gradients = gradientsFor(initial, step);
    original.step(gradients);
    reference.step(gradients);
  }
  ASSERT_TRUE(original.fused());
  std::string bytes = saved(original);
  EXPECT_FALSE(original.fused());

  FlatOptimizer restored(kind.options, initial);
  for (size_t i = 0; i < initial.size(); ++i) {
    restored.parameters()[i].copy_(original.parameters()[i]);
  }
  torch::serialize::InputArchive archive;
  archive.load_from(bytes.data(), bytes.size());
  restored.load(archive);
  for (int step = 3; step < 6; ++step) {
    auto gradients = gradientsFor(initial, step);
    restored.step(gradients);
    reference.step(gradients);
    EXPECT_TRUE(restored.fused());
  }
  expectBitwiseEqual(
      restored.parameters(),
      reference.parameters,
      "three steps after the checkpoint");
}

INSTANTIATE_TEST_SUITE_P(
    AllKinds,
    FlatOptimizerTest,
    ::testing::Values(
        Kind{
            "Sgd",
            torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true),
            false},
        Kind{
            "Adam",
            torch::optim::AdamOptions(0.01).weight_decay(0.001).amsgrad(true),
            true},
        Kind{"AdamW", torch::optim::AdamWOptions(0.01), true},
        Kind{
            "Adagrad",
            torch::optim::AdagradOptions(0.05).lr_decay(0.01).weight_decay(0.1),
            true},
        Kind{
            "Rmsprop",
            torch::optim::RMSpropOptions(0.01).momentum(0.5).centered(true),
            true}),
    [](const ::testing::TestParamInfo<Kind>& info) { return info.param.name; });

// Parameters of two dtypes cannot share a buffer: every step runs per
// parameter, still libtorch's.
TEST(FlatOptimizer, MixedDtypesStepPerParameter) {
  OptimizerOptions options = torch::optim::AdamOptions(0.01);
  auto initial = initialValues(at::kDouble);
  FlatOptimizer flat(options, initial);
  Reference reference(options, initial);
  for (int step = 0; step < 3; ++step) {
    auto gradients = gradientsFor(initial, step);
    flat.step(gradients);
    reference.step(gradients);
    EXPECT_FALSE(flat.fused());
  }
  expectBitwiseEqual(flat.parameters(), reference.parameters, "3 steps");
  EXPECT_EQ(flat.parameters()[1].scalar_type(), at::kDouble);
}

// A sparse gradient (an embedding's) takes the per-parameter path, which
// libtorch's SGD handles.
TEST(FlatOptimizer, SparseGradientStepsPerParameter) {
  OptimizerOptions options = torch::optim::SGDOptions(0.1);
  auto initial = initialValues();
  FlatOptimizer flat(options, initial);
  Reference reference(options, initial);
  auto gradients = gradientsFor(initial, 0);
  gradients[3] = gradients[3].to_sparse();
  EXPECT_EQ(flat.step(gradients), 4);
  reference.step(gradients);
  EXPECT_FALSE(flat.fused());
  expectBitwiseEqual(flat.parameters(), reference.parameters, "one step");
  EXPECT_FALSE(at::equal(flat.parameters()[3], initial[3]));
}

// No gradient at all: nothing moves.
TEST(FlatOptimizer, StepWithoutGradientsChangesNothing) {
  OptimizerOptions options = torch::optim::AdamOptions(0.01);
  auto initial = initialValues();
  FlatOptimizer flat(options, initial);
  EXPECT_EQ(flat.step(std::vector<at::Tensor>(initial.size())), 0);
  expectBitwiseEqual(flat.parameters(), initial, "an empty step");
  EXPECT_THROW(flat.step({}), c10::Error);
}

} // namespace
} // namespace testing
} // namespace torchrpc
