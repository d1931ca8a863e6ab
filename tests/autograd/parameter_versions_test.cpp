// Tier 1: ParameterVersions maps every published version of a parameter to
// its slot, sums a context's gradients per slot, and holds versions weakly
// (Note [Parameters updated while backward passes are pending]).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "torchrpc/autograd/parameter_versions.h"

namespace torchrpc {
namespace autograd {
namespace {

TEST(ParameterVersions, VersionsShareTheirParametersSlot) {
  ParameterVersions versions;
  at::Tensor w0 = at::ones({2});
  at::Tensor b0 = at::zeros({3});
  int64_t w = versions.slotOf(w0);
  int64_t b = versions.slotOf(b0);
  EXPECT_NE(w, b);
  EXPECT_EQ(versions.slotOf(w0), w);
  at::Tensor w1 = w0.clone();
  EXPECT_EQ(versions.find(w1), -1);
  versions.add(w, w1);
  EXPECT_EQ(versions.find(w1), w);
  EXPECT_EQ(versions.find(at::ones({2})), -1);
  EXPECT_THROW(versions.add(99, at::ones({1})), c10::Error);
}

TEST(ParameterVersions, GradientsOfSeveralVersionsAddUpPerSlot) {
  ParameterVersions versions;
  at::Tensor w0 = at::ones({2});
  at::Tensor w1 = w0.clone();
  at::Tensor other = at::ones({2});
  int64_t w = versions.slotOf(w0);
  versions.add(w, w1);
  c10::Dict<at::Tensor, at::Tensor> gradients;
  gradients.insert(w0, at::full({2}, 1.5));
  gradients.insert(w1, at::full({2}, 2.0));
  gradients.insert(other, at::full({2}, 7.0)); // no slot: left out
  auto bySlot = versions.bySlot(gradients);
  ASSERT_EQ(bySlot.size(), 1u);
  EXPECT_TRUE(at::equal(bySlot.at(w), at::full({2}, 3.5)));
  // The context's gradients are read-only: summing made a new tensor.
  EXPECT_TRUE(at::equal(gradients.at(w0), at::full({2}, 1.5)));
}

TEST(ParameterVersions, OldVersionsAreHeldWeakly) {
  ParameterVersions versions;
  at::Tensor w0 = at::ones({4});
  int64_t w = versions.slotOf(w0);
  {
    at::Tensor w1 = w0.clone();
    versions.add(w, w1);
    EXPECT_EQ(versions.size(), 2u);
  } // w1 is gone: its memory is not kept, and it counts no more
  EXPECT_EQ(versions.size(), 1u);
  // Many versions come and go; the table prunes what died.
  for (int i = 0; i < 1000; ++i) {
    versions.add(w, w0.clone());
  }
  EXPECT_EQ(versions.size(), 1u);
  EXPECT_EQ(versions.find(w0), w);
}

} // namespace
} // namespace autograd
} // namespace torchrpc
