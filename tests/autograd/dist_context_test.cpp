// Tier 1: what a DistContext keeps, driven directly — Note [Gradient
// ownership] (autograd/dist_context.h) case by case, and the error a release
// gives the passes still running.

#include "torchrpc/autograd/dist_context.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tests/support/local_cluster.h"
#include "torchrpc/autograd/engine/local_backward.h"
#include "torchrpc/rpc/errors.h"

namespace torchrpc {
namespace testing {
namespace {

using autograd::DistContext;
using Gradients = std::vector<std::pair<at::Tensor, at::Tensor>>;

// One leaf's gradient, handed over as the engine does: moved, so that the
// context holds the only reference the caller had. (An initializer list
// would copy it, and so hold it.)
void accumulate(DistContext& context, at::Tensor leaf, at::Tensor grad) {
  Gradients gradients;
  gradients.emplace_back(std::move(leaf), std::move(grad));
  context.accumulateGradients(std::move(gradients));
}

TEST(DistContextRelease, FailsRunningPassesNamingItsWorker) {
  DistContext context(7, "worker3");
  auto pass = std::make_shared<autograd::detail::LocalBackward>(
      7,
      1,
      "worker3",
      /*retainGraph=*/false,
      nullptr,
      nullptr);
  context.addPass(pass);
  context.close();
  // Checked for null first: GCC 12 otherwise warns (-Wstringop-overflow)
  // about the atomic load through a pointer it cannot prove non-null.
  auto done = pass->done();
  ASSERT_TRUE(done);
  ASSERT_TRUE(done->completed());
  expectRpcErrorFrom(
      [&]() { done->waitAndThrow(); },
      rpc::ErrorCode::kShuttingDown,
      "worker3",
      {"context 7 was released during the pass", "autograd.backward"});
}

TEST(DistContextOwnership, ASoleGradientIsTaken) {
  DistContext context(1, "worker0");
  auto leaf = at::zeros({3}).requires_grad_();
  auto grad = at::ones({3});
  const void* data = grad.data_ptr();
  accumulate(context, leaf, std::move(grad));
  EXPECT_EQ(context.gradients().at(leaf).data_ptr(), data);
}

// The shape of every Linear layer's weight gradient: the transpose of a
// matmul's result, a view whose base only it holds.
TEST(DistContextOwnership, ATransposedGradientNobodyElseSeesIsTakenAsItIs) {
  DistContext context(1, "worker0");
  auto leaf = at::zeros({3, 2}).requires_grad_();
  auto grad = at::arange(6, at::kFloat).reshape({2, 3}).t();
  const void* data = grad.data_ptr();
  accumulate(context, leaf, std::move(grad));
  auto owned = context.gradients().at(leaf);
  EXPECT_EQ(owned.data_ptr(), data);
  EXPECT_TRUE(at::equal(owned, at::arange(6, at::kFloat).reshape({2, 3}).t()));
}

TEST(DistContextOwnership, AGradientStillHeldElsewhereIsCopied) {
  DistContext context(1, "worker0");
  auto leaf = at::zeros({3}).requires_grad_();
  auto grad = at::ones({3});
  accumulate(context, leaf, grad);
  auto owned = context.gradients().at(leaf);
  EXPECT_NE(owned.data_ptr(), grad.data_ptr());
  owned.mul_(5);
  EXPECT_TRUE(at::equal(grad, at::ones({3})));
}

TEST(DistContextOwnership, AViewOfALiveTensorIsCopied) {
  DistContext context(1, "worker0");
  auto leaf = at::zeros({2}).requires_grad_();
  auto base = at::arange(4, at::kFloat);
  accumulate(context, leaf, base.narrow(0, 0, 2));
  auto owned = context.gradients().at(leaf);
  owned.fill_(-1);
  EXPECT_TRUE(at::equal(base, at::arange(4, at::kFloat)));
}

TEST(DistContextOwnership, AnExpandedGradientIsLaidOutLikeItsLeaf) {
  DistContext context(1, "worker0");
  auto leaf = at::zeros({2, 3}).t().requires_grad_(); // column-major leaf
  accumulate(context, leaf, at::ones({1}).expand({3, 2}));
  auto owned = context.gradients().at(leaf);
  EXPECT_EQ(owned.strides(), leaf.strides());
  EXPECT_TRUE(at::equal(owned, at::ones({3, 2})));
}

TEST(DistContextOwnership, SparseStaysSparseAndDenseWins) {
  DistContext context(1, "worker0");
  auto leaf = at::zeros({4, 2}).requires_grad_();
  auto sparse = [](int64_t row) {
    return at::sparse_coo_tensor(
        at::tensor({row}, at::kLong).reshape({1, 1}),
        at::ones({1, 2}),
        {4, 2});
  };
  accumulate(context, leaf, sparse(1));
  accumulate(context, leaf, sparse(3));
  auto sum = context.gradients().at(leaf);
  ASSERT_TRUE(sum.is_sparse());
  EXPECT_TRUE(at::equal(sum.to_dense(), (sparse(1) + sparse(3)).to_dense()));

  accumulate(context, leaf, at::full({4, 2}, 2.0f));
  auto dense = context.gradients().at(leaf);
  ASSERT_FALSE(dense.is_sparse());
  EXPECT_TRUE(at::equal(
      dense,
      at::full({4, 2}, 2.0f) + (sparse(1) + sparse(3)).to_dense()));
}

} // namespace
} // namespace testing
} // namespace torchrpc
