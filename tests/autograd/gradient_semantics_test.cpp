// Tier 2: what a distributed backward leaves in a context, checked against
// what libtorch's own engine leaves in .grad — the shapes of PyTorch's
// dist_autograd_test.py: who owns a gradient (Note [Gradient ownership] in
// autograd/dist_context.h), hooks on a leaf's accumulation node, backward
// roots, sparse gradients, and the worker every error names.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tests/support/autograd_zoo.h"
#include "tests/support/local_cluster.h"
#include "torchrpc/autograd/backward.h"
#include "torchrpc/autograd/context.h"
#include "torchrpc/autograd/context_container.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rref/rref_context.h"

namespace torchrpc {
namespace testing {
namespace {

using autograd::ContextContainer;

// Its backward hands on a fresh tensor and remembers where its bytes are;
// with keep, it also keeps a reference to it (as a graph or hook might).
struct FreshGradient : torch::autograd::Function<FreshGradient> {
  static std::atomic<const void*>& lastData() {
    static std::atomic<const void*> data{nullptr};
    return data;
  }
  static at::Tensor& kept() {
    static at::Tensor tensor;
    return tensor;
  }
  static at::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      const at::Tensor& x,
      bool keep) {
    ctx->saved_data["keep"] = keep;
    return x * 1;
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    at::Tensor fresh = grads[0] * 2;
    lastData() = fresh.data_ptr();
    if (ctx->saved_data["keep"].toBool()) {
      kept() = fresh;
    }
    return {fresh, at::Tensor()};
  }
};

// Records each call of a post-hook: what it was shown.
struct RecordingPostHook : torch::autograd::FunctionPostHook {
  explicit RecordingPostHook(std::shared_ptr<std::vector<at::Tensor>> seen)
      : seen_(std::move(seen)) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& inputs) override {
    EXPECT_TRUE(outputs.empty());
    EXPECT_EQ(inputs.size(), 1u);
    seen_->push_back(inputs.at(0).clone());
    return outputs;
  }
  std::shared_ptr<std::vector<at::Tensor>> seen_;
};

// torch::nn::EmbeddingBag(sparse=true) in sum mode, bags of two rows.
at::Tensor sparseEmbeddingBag(const at::Tensor& table, const at::Tensor& rows) {
  auto offsets = at::arange(0, rows.numel(), 2, at::kLong);
  return std::get<0>(at::embedding_bag(
      table,
      rows,
      offsets,
      /*scale_grad_by_freq=*/false,
      /*mode=*/0,
      /*sparse=*/true));
}

// Adds one to the gradient it is shown.
struct AddOnePreHook : torch::autograd::FunctionPreHook {
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& grads) override {
    return {grads.at(0) + 1};
  }
};

class GradientSemantics : public ::testing::TestWithParam<rpc::TransportKind> {
 protected:
  void SetUp() override {
    auto table = table_;
    cluster_ = std::make_unique<LocalCluster>(
        GetParam(),
        2,
        nullptr,
        [table](int, rpc::Runtime& rt) {
          rref::RRefContext::install(rt);
          ContextContainer::install(rt);
          rt.functions().add("times3", [](at::Tensor x) { return x * 3; });
          // Its backward sleeps a second.
          rt.functions().add("slow", [](at::Tensor x) {
            return zoo::SlowBackward::apply(x, 1000);
          });
          // Bags of rows of worker1's table, summed; its gradient is
          // sparse.
          rt.functions().add("embed", [table](at::Tensor rows) {
            return sparseEmbeddingBag(*table, rows);
          });
        });
  }
  void TearDown() override {
    EXPECT_TRUE(cluster_->shutdownAll());
  }
  rpc::Runtime& rt(int rank) {
    return (*cluster_)[rank];
  }
  // x's trip through worker1 and back: times 3 there.
  at::Tensor remoteTimes3(const at::Tensor& x) {
    return rt(0).rpcSync<at::Tensor>("worker1", "times3", x);
  }
  // The table "embed" reads (set by the test that uses it).
  std::shared_ptr<at::Tensor> table_ = std::make_shared<at::Tensor>();
  std::unique_ptr<LocalCluster> cluster_;
};

TEST_P(GradientSemantics, AnExpandedGradientBecomesAContiguousBufferOfItsOwn) {
  auto a = at::arange(6, at::kFloat).reshape({2, 3}).requires_grad_();
  autograd::Context context(rt(0));
  // sum()'s backward hands `a` a stride-0 expansion of one number.
  auto loss = remoteTimes3(a.sum());
  context.backward({loss});
  auto grad = context.gradients().at(a);
  EXPECT_TRUE(grad.is_contiguous());
  EXPECT_EQ(grad.strides(), a.strides());
  EXPECT_TRUE(at::equal(grad, at::full({2, 3}, 3.0f)));
  // An expanded tensor would refuse this ("more than one element of the
  // written-to tensor refers to a single memory location").
  grad.mul_(2);
  EXPECT_TRUE(at::equal(context.gradients().at(a), at::full({2, 3}, 6.0f)));
}

TEST_P(GradientSemantics, TwoLeavesGivenOneGradientGetTwoBuffers) {
  auto a = at::ones({4}).requires_grad_();
  auto b = at::ones({4}).requires_grad_();
  autograd::Context context(rt(0));
  // add's backward hands the same tensor to both of its inputs.
  auto loss = remoteTimes3(a + b).sum();
  context.backward({loss});
  auto grads = context.gradients();
  auto ga = grads.at(a);
  auto gb = grads.at(b);
  EXPECT_TRUE(at::equal(ga, at::full({4}, 3.0f)));
  EXPECT_TRUE(at::equal(gb, at::full({4}, 3.0f)));
  EXPECT_NE(ga.data_ptr(), gb.data_ptr());
  ga.zero_(); // clipping one leaf's gradient leaves the other's alone
  EXPECT_TRUE(at::equal(context.gradients().at(b), at::full({4}, 3.0f)));
}

TEST_P(GradientSemantics, AGradientThatIsAViewIsCopied) {
  auto a = at::ones({2}).requires_grad_();
  auto b = at::ones({3}).requires_grad_();
  autograd::Context context(rt(0));
  // cat's backward hands each input a narrowed view of one gradient.
  auto joined = at::cat({a, b});
  auto loss = (remoteTimes3(joined) * at::arange(5, at::kFloat)).sum();
  context.backward({loss});
  auto ga = context.gradients().at(a);
  auto gb = context.gradients().at(b);
  EXPECT_TRUE(at::equal(ga, at::tensor({0.0f, 3.0f})));
  EXPECT_TRUE(at::equal(gb, at::tensor({6.0f, 9.0f, 12.0f})));
  EXPECT_EQ(ga.storage().nbytes(), 2 * sizeof(float));
  ga.fill_(-1);
  EXPECT_TRUE(
      at::equal(context.gradients().at(b), at::tensor({6.0f, 9.0f, 12.0f})));
}

TEST_P(GradientSemantics, AGradientNobodyElseSeesIsTakenWithoutACopy) {
  auto a = at::ones({8}).requires_grad_();
  autograd::Context context(rt(0));
  auto loss = remoteTimes3(FreshGradient::apply(a, /*keep=*/false)).sum();
  context.backward({loss});
  EXPECT_EQ(
      context.gradients().at(a).data_ptr(),
      FreshGradient::lastData().load());
  EXPECT_TRUE(at::equal(context.gradients().at(a), at::full({8}, 6.0f)));
}

TEST_P(GradientSemantics, AGradientSomeoneElseHoldsIsCopied) {
  auto a = at::ones({8}).requires_grad_();
  autograd::Context context(rt(0));
  auto loss = remoteTimes3(FreshGradient::apply(a, /*keep=*/true)).sum();
  context.backward({loss});
  auto grad = context.gradients().at(a);
  EXPECT_NE(grad.data_ptr(), FreshGradient::lastData().load());
  grad.add_(1);
  EXPECT_TRUE(at::equal(FreshGradient::kept(), at::full({8}, 6.0f)));
  FreshGradient::kept() = at::Tensor();
}

TEST_P(GradientSemantics, LaterPassesAccumulateIntoTheSameBuffer) {
  auto a = at::ones({3}).requires_grad_();
  autograd::Context context(rt(0));
  auto loss = remoteTimes3(a * 2).sum();
  autograd::BackwardOptions retain;
  retain.retainGraph = true;
  context.backward({loss}, {}, retain);
  auto first = context.gradients().at(a);
  context.backward({loss});
  EXPECT_TRUE(at::equal(context.gradients().at(a), at::full({3}, 12.0f)));
  // As into .grad: in place, so what the user holds sees the sum.
  EXPECT_TRUE(context.gradients().at(a).is_same(first));
}

TEST_P(GradientSemantics, HooksOfALeafRunAsInALocalBackward) {
  auto run = [this](bool distributed) {
    auto a = at::tensor({1.0f, -2.0f, 0.5f}).requires_grad_();
    a.register_hook([](at::Tensor grad) { return grad * 10; });
    auto seen = std::make_shared<std::vector<at::Tensor>>();
    // The leaf keeps only a weak reference to its accumulator: hold it, or
    // the hook goes with it before the forward makes a new one.
    auto accumulator = torch::autograd::impl::grad_accumulator(a);
    accumulator->add_pre_hook(std::make_unique<AddOnePreHook>());
    accumulator->add_post_hook(std::make_unique<RecordingPostHook>(seen));
    at::Tensor got;
    if (distributed) {
      autograd::Context context(rt(0));
      auto loss = (remoteTimes3(a) * a).sum();
      context.backward({loss});
      got = context.gradients().at(a);
      EXPECT_FALSE(a.grad().defined());
    } else {
      auto loss = (a * 3 * a).sum();
      loss.backward();
      got = a.grad();
    }
    return std::make_pair(got, *seen);
  };
  auto local = run(false);
  auto dist = run(true);
  EXPECT_TRUE(at::equal(dist.first, local.first))
      << dist.first << " vs " << local.first;
  // The hooks did something: without them the gradient is 6a.
  auto withoutHooks = at::tensor({6.0f, -12.0f, 3.0f});
  EXPECT_FALSE(at::equal(local.first, withoutHooks));
  ASSERT_EQ(local.second.size(), 1u);
  ASSERT_EQ(dist.second.size(), 1u) << "the post-hook runs once per pass";
  EXPECT_TRUE(at::equal(dist.second[0], local.second[0]))
      << dist.second[0] << " vs " << local.second[0];
}

TEST_P(GradientSemantics, ALeafRootIsRefusedNamingIt) {
  auto a = at::ones({1}).requires_grad_();
  auto b = at::ones({1}).requires_grad_();
  autograd::Context context(rt(0));
  auto loss = remoteTimes3(a).sum();
  try {
    context.backward({loss, b});
    FAIL() << "a leaf root was accepted";
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    EXPECT_NE(
        what.find("root 1 of backward is a leaf tensor"),
        std::string::npos)
        << what;
    EXPECT_NE(
        what.find("does not have a valid gradient function"),
        std::string::npos)
        << what;
  }
  EXPECT_FALSE(b.grad().defined());
}

// A sparse EmbeddingBag on worker1, a dense head on worker0, trained by
// hand with SGD for a few steps: the parameters equal the same model
// trained in one process, bit for bit.
TEST_P(GradientSemantics, ASparseEmbeddingBagTrainsAsInOneProcess) {
  auto initialTable = at::sin(at::arange(40, at::kFloat)).reshape({10, 4});
  auto initialHead = at::cos(at::arange(4, at::kFloat));
  *table_ = initialTable.clone().requires_grad_();
  auto& table = *table_;
  std::vector<at::Tensor> batches = {
      at::tensor({1, 3, 3, 7}, at::kLong),
      at::tensor({0, 9, 2, 2}, at::kLong),
      at::tensor({3, 3, 3, 1}, at::kLong)};
  const double lr = 0.1;

  // Local reference.
  auto localTable = initialTable.clone().requires_grad_();
  auto localHead = initialHead.clone().requires_grad_();
  for (const auto& batch : batches) {
    auto bags = sparseEmbeddingBag(localTable, batch);
    auto loss = (bags.mv(localHead)).pow(2).sum();
    loss.backward();
    ASSERT_TRUE(localTable.grad().is_sparse());
    {
      at::NoGradGuard noGrad;
      localTable.sub_(localTable.grad() * lr);
      localHead.sub_(localHead.grad() * lr);
    }
    localTable.mutable_grad() = at::Tensor();
    localHead.mutable_grad() = at::Tensor();
  }

  // Distributed: worker1 looks up rows of its table; worker0 holds the head.
  auto head = initialHead.clone().requires_grad_();
  auto embed = [&](const at::Tensor& batch) {
    return rt(0).rpcSync<at::Tensor>("worker1", "embed", batch);
  };
  for (const auto& batch : batches) {
    autograd::Context context(rt(0));
    auto loss = (embed(batch).mv(head)).pow(2).sum();
    context.backward({loss});
    auto tableGrads =
        ContextContainer::of(rt(1))->find(context.id())->gradients();
    auto tableGrad = tableGrads.at(table);
    ASSERT_TRUE(tableGrad.is_sparse());
    at::NoGradGuard noGrad;
    table.sub_(tableGrad * lr);
    head.sub_(context.gradients().at(head) * lr);
  }
  EXPECT_TRUE(at::equal(table.detach(), localTable.detach()));
  EXPECT_TRUE(at::equal(head.detach(), localHead.detach()));
}

TEST_P(GradientSemantics, APassEndedByReleasingItsContextNamesTheWorker) {
  auto a = at::ones({2}).requires_grad_();
  c10::intrusive_ptr<c10::ivalue::Future> pass;
  {
    autograd::Context context(rt(0));
    auto loss = rt(0).rpcSync<at::Tensor>("worker1", "slow", a).sum();
    pass = autograd::backwardAsync(rt(0), context.id(), {loss});
  } // released while worker1's node sleeps
  // Which side notices first is a race: the driver's own release fails its
  // part of the pass, worker1's gradients find no context on worker0 (both
  // name worker0), or the release forwarded to worker1 fails worker1's part
  // while its node sleeps (naming worker1). Each names the worker that saw
  // the context gone.
  try {
    pass->waitAndThrow();
    ADD_FAILURE() << "the pass outlived its context";
  } catch (const rpc::RpcError& e) {
    EXPECT_TRUE(e.worker() == "worker0" || e.worker() == "worker1") << e.what();
    EXPECT_EQ(e.function(), "autograd.backward") << e.what();
    EXPECT_NE(std::string(e.what()).find("released"), std::string::npos)
        << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    GradientSemantics,
    ::testing::Values(rpc::TransportKind::kInProcess, rpc::TransportKind::kTcp),
    transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
