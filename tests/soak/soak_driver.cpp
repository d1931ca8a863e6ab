#include "tests/soak/soak_driver.h"

#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <exception>
#include <utility>

namespace torchrpc {
namespace soak {

namespace {
constexpr int64_t kFeatures = 8;
constexpr int64_t kOut = 4;
constexpr int64_t kBatch = 16;
} // namespace

// Worker r's model: a Linear 8->8 on worker r+1, W (8x4) on worker r+2.
struct SoakDriver::Model {
  Model(torchrpc::Runtime& rt, int64_t fcOwner, int64_t wOwner)
      : fc(rt, rt.worker(fcOwner).name + "/cpu", kFeatures, kFeatures),
        w(rt.remote<at::Tensor>(wOwner, "soak.makeW", kFeatures, kOut)),
        wOwner(wOwner),
        optimizer(rt, parameters(), torch::optim::SGDOptions(0.01)) {}

  std::vector<RRef<at::Tensor>> parameters() const {
    auto out = fc.remoteParameters();
    out.push_back(w);
    return out;
  }

  nn::RemoteModule<torch::nn::Linear> fc;
  RRef<at::Tensor> w;
  int64_t wOwner;
  optim::DistributedOptimizer optimizer;
};

SoakDriver::SoakDriver(torchrpc::Runtime& rt, SoakState& state, uint32_t seed)
    : rt_(rt),
      state_(state),
      rng_(seed) {
  int64_t world = static_cast<int64_t>(rt.workers().size());
  model_ = std::make_unique<Model>(
      rt,
      (rt.rank() + 1) % world,
      (rt.rank() + 2) % world);
}

SoakDriver::~SoakDriver() = default;

int64_t SoakDriver::pickPeer() {
  int64_t world = static_cast<int64_t>(rt_.workers().size());
  int64_t offset = std::uniform_int_distribution<int64_t>(1, world - 1)(rng_);
  return (rt_.rank() + offset) % world;
}

void SoakDriver::run(
    std::chrono::steady_clock::time_point until,
    const std::function<void()>& tick) {
  // Weights of: call, create, read, fork, drop, train.
  std::discrete_distribution<int> pickOp({40, 12, 8, 15, 10, 15});
  while (std::chrono::steady_clock::now() < until) {
    int op = pickOp(rng_);
    if (held_.empty() && (op == 2 || op == 3 || op == 4)) {
      op = 1;
    }
    switch (op) {
      case 0:
        plainCall();
        break;
      case 1:
        createRRef();
        break;
      case 2:
        readRRef();
        break;
      case 3:
        fork();
        break;
      case 4:
        drop();
        break;
      default:
        trainStep();
        break;
    }
    if (held_.size() > kMaxHeld) {
      held_.erase(held_.begin());
      counts_.drops++;
    }
    tick();
  }
}

void SoakDriver::plainCall() {
  int64_t callee = pickPeer();
  int64_t seq = state_.ledger.nextSeq(callee);
  at::Tensor x = at::arange(16, at::kFloat) + static_cast<double>(rt_.rank());
  calls_.push_back(
      {rt_.rpcAsync<at::Tensor>(callee, "soak.call", rt_.rank(), seq, x),
       callee,
       seq,
       x});
  counts_.calls++;
  if (calls_.size() > kCallWindow) {
    settleOldestCall();
  }
}

void SoakDriver::settleOldestCall() {
  Call call = std::move(calls_.front());
  calls_.pop_front();
  try {
    at::Tensor y = call.future.wait();
    state_.ledger.answered(
        call.callee,
        at::equal(y, callAnswer(call.x, call.seq)));
  } catch (const std::exception& e) {
    state_.ledger.failed(call.callee);
    throw;
  }
}

void SoakDriver::createRRef() {
  auto n = std::uniform_int_distribution<int64_t>(1, 64)(rng_);
  double base = std::uniform_int_distribution<int>(-1000, 1000)(rng_);
  held_.push_back(
      {rt_.remote<at::Tensor>(pickPeer(), "soak.fill", n, base),
       static_cast<double>(n) * base});
  counts_.rrefsCreated++;
}

void SoakDriver::readRRef() {
  const Held& held = held_[rng_() % held_.size()];
  double sum = held.rref.toHere().sum().item<double>();
  if (sum != held.sum) {
    problems_.push_back(
        "RRef " + held.rref.ownerName() + " read " + std::to_string(sum) +
        ", expected " + std::to_string(held.sum));
  }
  counts_.rrefReads++;
}

void SoakDriver::fork() {
  size_t i = rng_() % held_.size();
  // A third worker: neither this one nor the owner.
  int64_t to = pickPeer();
  while (to == held_[i].rref.owner().id) {
    to = pickPeer();
  }
  bool keep = rng_() % 2 == 0;
  forks_.push_back(rt_.rpcAsync<bool>(
      to,
      "soak.checkFork",
      held_[i].rref,
      held_[i].sum,
      keep));
  counts_.forks++;
  if (rng_() % 2 == 0) {
    // Often while the fork is still in flight.
    held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
    counts_.drops++;
  }
  if (forks_.size() > kForkWindow) {
    settleOldestFork();
  }
}

void SoakDriver::settleOldestFork() {
  rpc::Future<bool> future = std::move(forks_.front());
  forks_.pop_front();
  if (!future.wait()) {
    problems_.push_back("a third worker read a forked RRef's wrong value");
  }
}

void SoakDriver::drop() {
  held_.erase(
      held_.begin() + static_cast<std::ptrdiff_t>(rng_() % held_.size()));
  counts_.drops++;
}

void SoakDriver::trainStep() {
  int64_t step = step_++;
  at::Tensor x =
      at::sin(at::arange(kBatch * kFeatures, at::kFloat) * 0.37 + step)
          .reshape({kBatch, kFeatures});
  at::Tensor target =
      at::cos(at::arange(kBatch * kOut, at::kFloat) * 0.21 - step)
          .reshape({kBatch, kOut});
  autograd::Context context(rt_);
  at::Tensor h = at::relu(model_->fc.forward(x));
  at::Tensor y =
      rt_.rpcSync<at::Tensor>(model_->wOwner, "soak.wMatmul", model_->w, h);
  at::Tensor loss = (y - target).pow(2).mean();
  context.backward({loss});
  model_->optimizer.step(context.id());
  if (!std::isfinite(loss.item<double>())) {
    problems_.push_back("step " + std::to_string(step) + ": loss not finite");
  }
  counts_.trainSteps++;
}

std::vector<std::string> SoakDriver::drain(std::chrono::milliseconds timeout) {
  while (!calls_.empty()) {
    settleOldestCall();
  }
  while (!forks_.empty()) {
    settleOldestFork();
  }
  held_.clear();
  model_.reset();
  std::vector<std::string> out = problems_;
  if (!rt_.autogradContexts().waitForReleases(timeout)) {
    out.push_back("autograd releases still unanswered after the drain");
  }
  return out;
}

} // namespace soak
} // namespace torchrpc
