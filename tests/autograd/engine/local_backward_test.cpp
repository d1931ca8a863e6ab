// Tier 1: the local scheduler of Note [Distributed backward]
// (autograd/engine/dist_engine.h), driven directly: LocalBackward knows
// nothing of messages, so fake callbacks stand for the engine. Gradients are
// compared with libtorch's own autograd on the same graph.

#include "torchrpc/autograd/engine/local_backward.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "torchrpc/autograd/send_recv_functions.h"
#include "torchrpc/rpc/errors.h"

namespace torchrpc {
namespace testing {
namespace {

using autograd::RecvFunction;
using autograd::SendFunction;
using autograd::detail::LocalBackward;
using torch::autograd::variable_list;

constexpr int64_t kContextId = 7;
constexpr int64_t kPassId = 1;

struct ThrowingBackward : torch::autograd::Function<ThrowingBackward> {
  static at::Tensor forward(
      torch::autograd::AutogradContext*,
      const at::Tensor& x) {
    return x * 1;
  }
  static variable_list backward(
      torch::autograd::AutogradContext*,
      variable_list) {
    throw std::runtime_error("thrown on purpose");
  }
};

// User code may throw what is not a std::exception.
struct ThrowingAnIntBackward
    : torch::autograd::Function<ThrowingAnIntBackward> {
  static at::Tensor forward(
      torch::autograd::AutogradContext*,
      const at::Tensor& x) {
    return x * 1;
  }
  static variable_list backward(
      torch::autograd::AutogradContext*,
      variable_list) {
    throw 42;
  }
};

// A pass with callbacks that record what it hands over.
class Pass {
 public:
  explicit Pass(bool retainGraph = false, int64_t contextId = kContextId) {
    pass_ = std::make_shared<LocalBackward>(
        contextId,
        kPassId,
        "worker0",
        retainGraph,
        [this](const std::shared_ptr<RecvFunction>& recv, variable_list grads) {
          if (!recvFails.empty()) {
            throw std::runtime_error(recvFails);
          }
          recvs.emplace_back(recv->messageId(), std::move(grads));
        },
        [this](std::vector<std::pair<at::Tensor, at::Tensor>> gradients) {
          ++leavesCalls;
          leaves = std::move(gradients);
        });
  }

  LocalBackward* operator->() const {
    return pass_.get();
  }

  // D2 on a driver: the roots' edges and gradients.
  LocalBackward::NewlyReached addRoots(
      const std::vector<at::Tensor>& roots,
      const std::vector<at::Tensor>& grads) {
    torch::autograd::edge_list edges;
    for (const auto& root : roots) {
      edges.push_back(torch::autograd::impl::gradient_edge(root));
    }
    return pass_->addRoots(edges, grads);
  }

  // D2 + E1 on a driver.
  LocalBackward::NewlyReached runFrom(
      const std::vector<at::Tensor>& roots,
      const std::vector<at::Tensor>& grads) {
    auto reached = addRoots(roots, grads);
    pass_->start();
    return reached;
  }

  // The gradient the pass left for `leaf` (undefined if none).
  at::Tensor gradientOf(const at::Tensor& leaf) const {
    for (const auto& entry : leaves) {
      if (entry.first.unsafeGetTensorImpl() == leaf.unsafeGetTensorImpl()) {
        return entry.second;
      }
    }
    return at::Tensor();
  }

  bool succeeded() const {
    return pass_->done()->completed() && !pass_->done()->hasError();
  }

  std::vector<std::pair<int64_t, variable_list>> recvs;
  // When set, sending a recv's gradients throws this.
  std::string recvFails;
  std::vector<std::pair<at::Tensor, at::Tensor>> leaves;
  int leavesCalls = 0;

 private:
  std::shared_ptr<LocalBackward> pass_;
};

at::Tensor leaf(std::vector<int64_t> sizes, uint64_t seed) {
  at::manual_seed(seed);
  return at::randn(sizes, at::kDouble).requires_grad_();
}

// The SendFunction of a message of this context that sent `value` (as
// message `messageId`, to worker `to`).
std::shared_ptr<SendFunction> sendOf(
    const at::Tensor& value,
    int64_t messageId,
    int64_t to) {
  return std::make_shared<SendFunction>(
      kContextId,
      messageId,
      to,
      std::vector<at::Tensor>{value});
}

// `value` as received in `contextId` (message `messageId`, from worker
// `from`): its grad_fn is a RecvFunction.
at::Tensor received(
    const at::Tensor& value,
    int64_t contextId,
    int64_t messageId,
    int64_t from) {
  auto recv = std::make_shared<RecvFunction>(
      contextId,
      messageId,
      from,
      /*senderGraphIsFinal=*/true);
  std::vector<at::Tensor> tensors{value};
  recv->adopt(tensors);
  return tensors[0];
}

// libtorch's gradients of `roots` (with `grads`) for `leaves`, keeping the
// graph for the pass under test.
variable_list expected(
    const std::vector<at::Tensor>& roots,
    const std::vector<at::Tensor>& grads,
    const std::vector<at::Tensor>& leaves) {
  return torch::autograd::grad(
      roots,
      leaves,
      grads,
      /*retain_graph=*/true,
      /*create_graph=*/false);
}

void expectExactly(const at::Tensor& got, const at::Tensor& want) {
  ASSERT_TRUE(got.defined());
  EXPECT_TRUE(at::equal(got, want)) << "got " << got << " expected " << want;
}

// The code of the error `pass` failed with (and its text in `what`).
rpc::ErrorCode failureOf(const Pass& pass, std::string* what) {
  auto done = pass->done();
  EXPECT_TRUE(done->completed());
  EXPECT_TRUE(done->hasError());
  try {
    std::rethrow_exception(done->exception_ptr());
  } catch (const rpc::RpcError& e) {
    *what = e.what();
    return e.code();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "not an RpcError: " << e.what();
    return rpc::ErrorCode::kInternal;
  }
}

TEST(LocalBackward, AChainGetsLibtorchsGradientsExactly) {
  auto x = leaf({4}, 1);
  auto loss = ((x * 2).sin() * 3).exp().sum();
  auto want = expected({loss}, {at::ones_like(loss)}, {x});
  Pass pass;
  auto reached = pass.runFrom({loss}, {at::ones_like(loss)});
  EXPECT_TRUE(reached.empty());
  ASSERT_TRUE(pass.succeeded());
  EXPECT_EQ(pass.leavesCalls, 1);
  ASSERT_EQ(pass.leaves.size(), 1u);
  expectExactly(pass.gradientOf(x), want[0]);
  EXPECT_FALSE(x.grad().defined()) << "the pass must not touch .grad";
}

TEST(LocalBackward, FanOutAndFanInRunEachNodeOnceWithAllItsGradients) {
  auto x = leaf({3}, 2);
  auto w = leaf({3}, 3);
  auto h = x * w; // fans out to two branches that meet again
  auto loss = (h.exp() * h.cos()).sum();
  auto want = expected({loss}, {at::ones_like(loss)}, {x, w});
  Pass pass;
  pass.runFrom({loss}, {at::ones_like(loss)});
  ASSERT_TRUE(pass.succeeded());
  ASSERT_EQ(pass.leaves.size(), 2u);
  expectExactly(pass.gradientOf(x), want[0]);
  expectExactly(pass.gradientOf(w), want[1]);
}

TEST(LocalBackward, ALeafSharedByRootsSumsItsGradients) {
  auto w = leaf({2, 2}, 4);
  auto x = leaf({2, 2}, 5);
  auto first = (w * x).sum(1);
  auto second = w.mm(x).tanh();
  auto g1 = at::randn({2}, at::kDouble);
  auto g2 = at::randn({2, 2}, at::kDouble);
  auto want = expected({first, second}, {g1, g2}, {w, x});
  Pass pass;
  pass.runFrom({first, second}, {g1, g2});
  ASSERT_TRUE(pass.succeeded());
  expectExactly(pass.gradientOf(w), want[0]);
  expectExactly(pass.gradientOf(x), want[1]);
}

TEST(LocalBackward, RetainGraphAllowsASecondPassAndItsAbsenceFreesTheGraph) {
  auto x = leaf({3}, 6);
  auto loss = (x.sigmoid() * x).sum();
  auto want = expected({loss}, {at::ones_like(loss)}, {x});
  for (int run = 0; run < 2; ++run) {
    Pass pass(/*retainGraph=*/true);
    pass.runFrom({loss}, {at::ones_like(loss)});
    ASSERT_TRUE(pass.succeeded()) << "run " << run;
    expectExactly(pass.gradientOf(x), want[0]);
  }
  Pass last(/*retainGraph=*/false);
  last.runFrom({loss}, {at::ones_like(loss)});
  ASSERT_TRUE(last.succeeded());
  expectExactly(last.gradientOf(x), want[0]);
  // The saved tensors are gone, as after libtorch's own backward.
  EXPECT_THROW(expected({loss}, {at::ones_like(loss)}, {x}), c10::Error);
}

TEST(LocalBackward, ARecvGetsItsGradientsThroughTheCallback) {
  auto x = leaf({3}, 7);
  auto value = leaf({3}, 8);
  auto t = received(value, kContextId, /*messageId=*/42, /*from=*/1);
  auto loss = (t * x).sum() + t.sum();
  Pass pass;
  auto reached = pass.runFrom({loss}, {at::ones_like(loss)});
  ASSERT_EQ(reached.size(), 1u);
  EXPECT_EQ(reached.at(1), std::vector<int64_t>{42});
  ASSERT_TRUE(pass.succeeded());
  ASSERT_EQ(pass.recvs.size(), 1u);
  EXPECT_EQ(pass.recvs[0].first, 42);
  ASSERT_EQ(pass.recvs[0].second.size(), 1u);
  // d loss / d received = x + 1: two gradients summed at the recv.
  expectExactly(pass.recvs[0].second[0], x.detach() + 1);
  expectExactly(pass.gradientOf(x), value.detach());
}

TEST(LocalBackward, GradientsThatCannotBeSentFailThePass) {
  auto x = leaf({3}, 7);
  auto t = received(leaf({3}, 8), kContextId, /*messageId=*/42, /*from=*/1);
  auto loss = (t * x).sum();
  Pass pass;
  pass.recvFails = "no way to worker1";
  pass.runFrom({loss}, {at::ones_like(loss)});
  std::string what;
  EXPECT_EQ(failureOf(pass, &what), rpc::ErrorCode::kInternal);
  EXPECT_NE(what.find("recv #42"), std::string::npos) << what;
  EXPECT_NE(what.find("no way to worker1"), std::string::npos) << what;
  EXPECT_EQ(pass.leavesCalls, 0) << "a failed pass leaves no gradients";
}

TEST(LocalBackward, UnansweredGradientMessagesHoldThePassOpen) {
  auto loss = (received(leaf({2}, 9), kContextId, 5, 2) * 3).sum();
  Pass pass;
  pass.addRoots({loss}, {at::ones_like(loss)});
  // What the engine does when it sends a recv's gradients.
  pass->addUnacknowledged();
  pass->start();
  ASSERT_EQ(pass.recvs.size(), 1u);
  EXPECT_FALSE(pass->done()->completed());
  pass->acknowledged();
  EXPECT_TRUE(pass.succeeded());
}

TEST(LocalBackward, AMarkedSendRunsWhenItsGradientsAreDelivered) {
  auto x = leaf({3}, 10);
  auto sent = (x * x).cos();
  auto send = sendOf(sent, /*messageId=*/11, /*toWorker=*/0);
  auto grad = at::randn({3}, at::kDouble);
  auto want = expected({sent}, {grad}, {x});
  Pass pass;
  auto reached = pass->markSends({send});
  EXPECT_TRUE(reached.empty());
  EXPECT_EQ(
      pass->waitingSends(),
      (std::vector<std::pair<int64_t, int64_t>>{{11, 0}}));
  EXPECT_FALSE(pass->done()->completed());
  pass->deliver(11, {grad});
  ASSERT_TRUE(pass.succeeded());
  EXPECT_TRUE(pass->waitingSends().empty());
  expectExactly(pass.gradientOf(x), want[0]);
}

TEST(LocalBackward, GradientsHeldUntilArmedAreDeliveredThen) {
  auto x = leaf({2}, 12);
  auto sent = x.exp();
  auto send = sendOf(sent, 13, 0);
  auto grad = at::randn({2}, at::kDouble);
  auto want = expected({sent}, {grad}, {x});
  Pass pass;
  pass->holdDeliveries();
  pass->deliver(13, {grad}); // D2': before the kAwait that marks the send
  EXPECT_FALSE(pass->done()->completed());
  EXPECT_TRUE(pass.leaves.empty());
  pass->arm({send});
  ASSERT_TRUE(pass.succeeded());
  expectExactly(pass.gradientOf(x), want[0]);
}

TEST(LocalBackward, DeliveriesItDoesNotWaitForAreRefused) {
  auto x = leaf({2}, 14);
  auto send = sendOf(x * 2, 15, 0);
  Pass pass;
  pass->markSends({send});
  auto expectRefused = [&](int64_t messageId,
                           variable_list grads,
                           const std::string& why) {
    try {
      pass->deliver(messageId, std::move(grads));
      ADD_FAILURE() << "accepted: " << why;
    } catch (const rpc::RpcError& e) {
      EXPECT_EQ(e.code(), rpc::ErrorCode::kBadArguments);
      EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
    }
  };
  expectRefused(16, {at::ones({2}, at::kDouble)}, "does not wait for them");
  expectRefused(15, {at::ones({3}, at::kDouble)}, "the tensor sent was");
  expectRefused(15, {}, "0 gradients for 1 tensors");
  pass->deliver(15, {at::ones({2}, at::kDouble)});
  EXPECT_TRUE(pass.succeeded());
  expectRefused(15, {at::ones({2}, at::kDouble)}, "arrived twice");
}

TEST(LocalBackward, ANodeThatThrowsFailsThePassNamingIt) {
  auto x = leaf({2}, 17);
  auto loss = ThrowingBackward::apply(x * 2).sum();
  Pass pass;
  pass.runFrom({loss}, {at::ones_like(loss)});
  std::string what;
  EXPECT_EQ(failureOf(pass, &what), rpc::ErrorCode::kRemoteException);
  EXPECT_NE(what.find("thrown on purpose"), std::string::npos) << what;
  EXPECT_NE(what.find("worker0"), std::string::npos) << what;
  EXPECT_EQ(pass.leavesCalls, 0) << "a failed pass leaves no gradients";
}

TEST(LocalBackward, ANodeThatThrowsAnythingFailsThePass) {
  auto x = leaf({2}, 19);
  auto loss = ThrowingAnIntBackward::apply(x * 2).sum();
  Pass pass;
  pass.runFrom({loss}, {at::ones_like(loss)});
  std::string what;
  EXPECT_EQ(failureOf(pass, &what), rpc::ErrorCode::kRemoteException);
  EXPECT_NE(what.find("ThrowingAnIntBackward"), std::string::npos) << what;
  EXPECT_NE(what.find("unknown exception"), std::string::npos) << what;
  EXPECT_EQ(pass.leavesCalls, 0) << "a failed pass leaves no gradients";
}

TEST(LocalBackward, TheFirstErrorSticks) {
  auto x = leaf({2}, 18);
  auto send = sendOf(x * 2, 19, 0);
  Pass pass;
  pass->markSends({send});
  pass->fail(rpc::makeRpcError(
      rpc::ErrorCode::kWorkerUnavailable,
      "worker1",
      "test",
      0,
      "first"));
  pass->fail(rpc::makeRpcError(
      rpc::ErrorCode::kTimeout,
      "worker1",
      "test",
      0,
      "second"));
  std::string what;
  EXPECT_EQ(failureOf(pass, &what), rpc::ErrorCode::kWorkerUnavailable);
  EXPECT_NE(what.find("first"), std::string::npos) << what;
  EXPECT_EQ(pass.leavesCalls, 0);
}

TEST(LocalBackward, AWalkIntoAnotherContextsTensorsIsRefused) {
  auto loss = received(leaf({2}, 20), kContextId + 1, 21, 1).sum();
  Pass pass;
  try {
    pass.addRoots({loss}, {at::ones_like(loss)});
    ADD_FAILURE() << "a walk crossed contexts";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("gradients cannot cross contexts"),
        std::string::npos)
        << e.what();
  }
}

} // namespace
} // namespace testing
} // namespace torchrpc
