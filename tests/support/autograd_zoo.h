#pragma once

// The distributed autograd topology zoo: small programs whose steps run on
// chosen workers, written once and run two ways — across workers (each step
// a call, each worker's parameters living there) and in one process with
// plain libtorch autograd (each step a function call) — so that the
// distributed gradients can be compared with local ones.

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace torchrpc {
namespace testing {
namespace zoo {

// Where a program's steps run, seen from one worker.
class Net {
 public:
  virtual ~Net() = default;
  virtual int rank() const = 0;
  // Runs `op` on worker `rank` (a call unless it is this one).
  virtual std::vector<at::Tensor> run(
      int rank,
      const std::string& op,
      std::vector<at::Tensor> inputs,
      std::vector<int64_t> path = {}) = 0;
  // This worker's parameter `name`: the same values in every Net.
  at::Tensor param(const std::string& name) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = params_.find(name);
    if (it == params_.end()) {
      it = params_.emplace(name, makeParam(rank(), name)).first;
    }
    return it->second;
  }
  // Whether `name` was created here (used by the program).
  at::Tensor findParam(const std::string& name) {
    std::lock_guard<std::mutex> guard(mutex_);
    auto it = params_.find(name);
    return it == params_.end() ? at::Tensor() : it->second;
  }

  // Deterministic values, different per worker and name. "W..." names are
  // 4x4 matrices, "E..." names 6x4 embedding tables, others 4-vectors.
  static at::Tensor makeParam(int rank, const std::string& name) {
    double salt = 0.1 * static_cast<double>(std::hash<std::string>()(name) % 7);
    int64_t rows = name[0] == 'W' ? 4 : name[0] == 'E' ? 6 : 1;
    int64_t n = rows * 4;
    auto values =
        (at::arange(1, n + 1, at::kFloat) * (0.3 + 0.2 * rank) + salt).sin();
    if (rows > 1) {
      values = values.reshape({rows, 4});
    }
    return values.requires_grad_();
  }

 private:
  std::mutex mutex_;
  std::map<std::string, at::Tensor> params_;
};

// A backward whose node fails or stalls, to test errors and deadlines.
struct ExplodingBackward : torch::autograd::Function<ExplodingBackward> {
  static at::Tensor forward(
      torch::autograd::AutogradContext*,
      const at::Tensor& x) {
    return x * 1;
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext*,
      torch::autograd::variable_list) {
    throw std::runtime_error("exploding backward, on purpose");
  }
};

// Fails the way libtorch's own checks do: a c10::Error, whose what() carries
// a C++ backtrace.
struct CheckFailingBackward : torch::autograd::Function<CheckFailingBackward> {
  static at::Tensor forward(
      torch::autograd::AutogradContext*,
      const at::Tensor& x) {
    return x * 1;
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext*,
      torch::autograd::variable_list) {
    TORCH_CHECK(false, "backward check failed, on purpose");
  }
};

struct SlowBackward : torch::autograd::Function<SlowBackward> {
  static at::Tensor forward(
      torch::autograd::AutogradContext* ctx,
      const at::Tensor& x,
      int64_t milliseconds) {
    ctx->saved_data["ms"] = milliseconds;
    return x * 1;
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    std::this_thread::sleep_for(
        std::chrono::milliseconds(ctx->saved_data["ms"].toInt()));
    return {grads[0], at::Tensor()};
  }
};

// Counts how often its backward runs (G1: once per pass).
struct CountingBackward : torch::autograd::Function<CountingBackward> {
  static std::atomic<int>& runs() {
    static std::atomic<int> count{0};
    return count;
  }
  static at::Tensor forward(
      torch::autograd::AutogradContext*,
      const at::Tensor& x) {
    return x * 1;
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext*,
      torch::autograd::variable_list grads) {
    ++runs();
    return {grads[0]};
  }
};

using Op = std::function<std::vector<at::Tensor>(
    Net& here,
    std::vector<at::Tensor> inputs,
    std::vector<int64_t> path)>;

// An embedding lookup whose gradient is a sparse COO tensor, as
// torch::nn::Embedding with sparse(true) makes it.
inline at::Tensor sparseEmbedding(
    const at::Tensor& table,
    const at::Tensor& indices) {
  return at::embedding(
      table,
      indices,
      /*padding_idx=*/-1,
      /*scale_grad_by_freq=*/false,
      /*sparse=*/true);
}

// What "relay" does after its nested call; "relay_async" shares it.
inline at::Tensor relayFinish(const at::Tensor& u, const at::Tensor& v) {
  return v * u.cos() + u;
}

inline const std::map<std::string, Op>& ops() {
  static const std::map<std::string, Op> table = {
      {"mul_w",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         return std::vector<at::Tensor>{in.at(0) * here.param("w")};
       }},
      {"tanh_w",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         return std::vector<at::Tensor>{(in.at(0) * here.param("w")).tanh()};
       }},
      {"mv_W",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         return std::vector<at::Tensor>{here.param("W").mv(in.at(0))};
       }},
      {"add_mul_w",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         return std::vector<at::Tensor>{
             (in.at(0) + in.at(1)) * here.param("w")};
       }},
      // Broadcasts its bias over a batch: the bias's gradient must be
      // reduced to its shape.
      {"linear",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         return std::vector<at::Tensor>{
             at::linear(in.at(0), here.param("W"), here.param("b")) +
             here.param("c")};
       }},
      {"mul",
       [](Net&, std::vector<at::Tensor> in, std::vector<int64_t>) {
         return std::vector<at::Tensor>{in.at(0) * in.at(1)};
       }},
      // Two outputs requiring grad; callers may use only one.
      {"split",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         auto x = in.at(0);
         return std::vector<at::Tensor>{x * here.param("w"), x.sin() * 2};
       }},
      // u = x * w here, then the rest of `path` with u, used twice here.
      {"relay",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t> path) {
         auto u = in.at(0) * here.param("w");
         if (path.empty()) {
           return std::vector<at::Tensor>{u.tanh()};
         }
         std::vector<int64_t> rest(path.begin() + 1, path.end());
         auto v = here.run(static_cast<int>(path[0]), "relay", {u}, rest).at(0);
         return std::vector<at::Tensor>{relayFinish(u, v)};
       }},
      // A tensor requiring grad, a float tensor that does not, an index.
      {"mixed",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         return std::vector<at::Tensor>{
             in.at(0).index_select(0, in.at(2)) * in.at(1) *
             here.param("w").narrow(0, 0, 3)};
       }},
      // A transposed matrix, a narrowed vector and an expanded one.
      {"views",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         auto mt = in.at(0);
         auto narrow = in.at(1);
         auto expanded = in.at(2);
         return std::vector<at::Tensor>{
             mt.mv(here.param("w")) + narrow.repeat({2}) * expanded};
       }},
      {"explode",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         return std::vector<at::Tensor>{
             ExplodingBackward::apply(in.at(0) * here.param("w"))};
       }},
      {"check_fail",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         return std::vector<at::Tensor>{
             CheckFailingBackward::apply(in.at(0) * here.param("w"))};
       }},
      {"slow",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t> path) {
         return std::vector<at::Tensor>{
             SlowBackward::apply(in.at(0) * here.param("w"), path.at(0))};
       }},
      {"loss",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         return std::vector<at::Tensor>{(in.at(0) * here.param("w")).sum()};
       }},
      // Rows of the table E picked by in[1] (sparse gradient), times in[0].
      {"embed_E",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         return std::vector<at::Tensor>{
             sparseEmbedding(here.param("E"), in.at(1)).mv(in.at(0))};
       }},
      // The table used sparsely and densely: its gradient becomes dense.
      {"embed_E_and_sum",
       [](Net& here, std::vector<at::Tensor> in, std::vector<int64_t>) {
         auto table = here.param("E");
         return std::vector<at::Tensor>{
             sparseEmbedding(table, in.at(1)).mv(in.at(0)) +
             table.sum(0).narrow(0, 0, 4)};
       }},
      // Sends the table itself: its sparse gradient comes back over the wire.
      {"table_E",
       [](Net& here, std::vector<at::Tensor>, std::vector<int64_t>) {
         return std::vector<at::Tensor>{here.param("E") * 1};
       }},
      // Embeds with a table that came from elsewhere.
      {"embed_with",
       [](Net&, std::vector<at::Tensor> in, std::vector<int64_t>) {
         return std::vector<at::Tensor>{
             sparseEmbedding(in.at(0), in.at(2)).mv(in.at(1))};
       }},
  };
  return table;
}

// The roots a program produced, with their gradients (empty: implicit).
struct Roots {
  std::vector<at::Tensor> roots;
  std::vector<at::Tensor> grads;
};

struct Case {
  std::string name;
  int worldSize;
  std::function<Roots(Net& driver)> program;
  // Parameters whose gradients are compared: (worker, name).
  std::vector<std::pair<int, std::string>> params;
  // Backward passes over the same graph (retainGraph for all but the last).
  int passes = 1;
  // 0: exact. Otherwise the absolute tolerance, for inputs that sum three
  // or more gradients (the order of those additions may differ).
  double tolerance = 0;
  // The program calls "relay_async", which only the distributed run has;
  // locally it is "relay".
};

inline at::Tensor input() {
  return at::tensor({0.5f, -1.25f, 2.0f, 0.75f});
}

// Rows of an "E" table, one repeated.
inline at::Tensor rows() {
  return at::tensor({1, 4, 1, 5}, at::kLong);
}

// The zoo. Worker 0 drives.
inline std::vector<Case> makeCases() {
  std::vector<Case> all;
  all.push_back(
      {"ChainAToBToC",
       3,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto y = n.run(1, "mul_w", {x}).at(0);
         auto z = n.run(2, "tanh_w", {y}).at(0);
         return Roots{{(z * n.param("v")).sum()}, {}};
       },
       {{0, "w"}, {0, "v"}, {1, "w"}, {2, "w"}}});
  all.push_back(
      {"CycleAToBToA",
       2,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto y = n.run(1, "relay", {x}, {0}).at(0);
         // x also reaches the loss directly: its node waits for both.
         return Roots{{(y + x * x).sum()}, {}};
       },
       {{0, "w"}, {1, "w"}}});
  all.push_back(
      {"CycleAToBToCToA",
       3,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto y = n.run(1, "relay", {x}, {2, 0}).at(0);
         return Roots{{(y * x).sum()}, {}};
       },
       {{0, "w"}, {1, "w"}, {2, "w"}}});
  all.push_back(
      {"Diamond",
       4,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto b = n.run(1, "mul_w", {x}).at(0);
         auto c = n.run(2, "tanh_w", {x}).at(0);
         auto d = n.run(3, "add_mul_w", {b, c}).at(0);
         return Roots{{d.sum()}, {}};
       },
       {{0, "w"}, {1, "w"}, {2, "w"}, {3, "w"}}});
  all.push_back(
      {"FanOutFanIn",
       4,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto sum = n.run(1, "mul_w", {x}).at(0) + n.run(2, "mv_W", {x}).at(0) +
             n.run(3, "tanh_w", {x}).at(0);
         return Roots{{sum.pow(2).sum()}, {}};
       },
       {{0, "w"}, {1, "w"}, {2, "W"}, {3, "w"}},
       1,
       1e-6});
  all.push_back(
      {"SameParameterOnTwoWorkers",
       3,
       [](Net& n) {
         auto w = n.param("w");
         auto x = input() * n.param("v");
         auto a = n.run(1, "mul", {x, w}).at(0);
         auto b = n.run(2, "mul", {a, w}).at(0);
         return Roots{{(b * w).sum()}, {}};
       },
       {{0, "w"}, {0, "v"}}});
  all.push_back(
      {"SeveralRoots",
       3,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto a = n.run(1, "tanh_w", {x}).at(0);
         auto b = n.run(2, "mul_w", {x}).at(0);
         return Roots{{a.sum(), (b * 3).sum()}, {}};
       },
       {{0, "w"}, {1, "w"}, {2, "w"}}});
  all.push_back(
      {"NonScalarRootWithItsGradient",
       2,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto y = n.run(1, "mv_W", {x}).at(0);
         return Roots{{y}, {at::tensor({1.0f, -2.0f, 0.5f, 3.0f})}};
       },
       {{0, "w"}, {1, "W"}}});
  all.push_back(
      {"RetainGraphTwoPassesAccumulate",
       3,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto y = n.run(1, "relay", {x}, {2}).at(0);
         return Roots{{y.sum()}, {}};
       },
       {{0, "w"}, {1, "w"}, {2, "w"}},
       2});
  all.push_back(
      {"UnusedRemoteOutputs",
       3,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto both = n.run(1, "split", {x});
         // A whole result that never reaches the loss, too.
         auto unused = n.run(2, "mul_w", {x});
         return Roots{{both.at(0).sum()}, {}};
       },
       {{0, "w"}, {1, "w"}, {2, "w"}}});
  all.push_back(
      {"TensorsWithoutGradAndIntegers",
       2,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto c = at::tensor({1.0f, 2.0f, 3.0f});
         auto index = at::tensor({3, 1, 1}, at::kLong);
         auto y = n.run(1, "mixed", {x, c, index}).at(0);
         return Roots{{(y * y).sum()}, {}};
       },
       {{0, "w"}, {1, "w"}}});
  all.push_back(
      {"ViewsAndNonContiguousTensors",
       2,
       [](Net& n) {
         auto m = n.param("W") * 2;
         auto v = input() * n.param("w");
         auto s = (n.param("w") * n.param("w")).sum().reshape({1});
         auto y =
             n.run(1, "views", {m.t(), v.narrow(0, 1, 2), s.expand({4})}).at(0);
         return Roots{{y.sum()}, {}};
       },
       {{0, "W"}, {0, "w"}, {1, "w"}},
       1,
       1e-6});
  all.push_back(
      {"BroadcastGradientsAreReduced",
       2,
       [](Net& n) {
         auto batch = at::stack({input(), input() * -2}) * n.param("w");
         auto y = n.run(1, "linear", {batch}).at(0);
         return Roots{{(y * y).sum()}, {}};
       },
       {{0, "w"}, {1, "W"}, {1, "b"}, {1, "c"}}});
  all.push_back(
      {"AsynchronousHandlers",
       3,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto y = n.run(1, "relay_async", {x}, {2}).at(0);
         return Roots{{(y * x).sum()}, {}};
       },
       {{0, "w"}, {1, "w"}, {2, "w"}}});

  // Sparse gradients (sparse embedding tables), in the shapes above.
  all.push_back(
      {"SparseChainAToBToC",
       3,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto y = n.run(1, "embed_E", {x, rows()}).at(0);
         auto z = n.run(2, "embed_E", {y, rows().flip(0)}).at(0);
         return Roots{{(z * n.param("v")).sum()}, {}};
       },
       {{0, "w"}, {0, "v"}, {1, "E"}, {2, "E"}}});
  all.push_back(
      {"SparseGradientCrossesTheWire",
       2,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto table = n.run(1, "table_E", {}).at(0);
         auto y = n.run(0, "embed_with", {table, x, rows()}).at(0);
         return Roots{{(y * y).sum()}, {}};
       },
       {{0, "w"}, {1, "E"}}});
  all.push_back(
      {"SparseFanOutFanIn",
       3,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto table = n.run(1, "table_E", {}).at(0);
         // The same remote table embedded on two workers: two sparse
         // gradients meet at worker1's send and stay sparse.
         auto a = n.run(2, "embed_with", {table, x, rows()}).at(0);
         auto b = n.run(0, "embed_with", {table, x * 2, rows().flip(0)}).at(0);
         return Roots{{(a * b).sum()}, {}};
       },
       {{0, "w"}, {1, "E"}}});
  all.push_back(
      {"SparseAndDenseGradientsMakeADenseOne",
       2,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto y = n.run(1, "embed_E_and_sum", {x, rows()}).at(0);
         return Roots{{y.pow(2).sum()}, {}};
       },
       {{0, "w"}, {1, "E"}}});
  all.push_back(
      {"SparseRetainGraphTwoPassesAccumulate",
       2,
       [](Net& n) {
         auto x = input() * n.param("w");
         auto y = n.run(1, "embed_E", {x, rows()}).at(0);
         return Roots{{y.sum()}, {}};
       },
       {{0, "w"}, {1, "E"}},
       2});
  return all;
}

inline const std::vector<Case>& cases() {
  static const std::vector<Case> all = makeCases();
  return all;
}

// Expects `got` to equal `expected` exactly, or within `tolerance`.
inline void expectGradient(
    const at::Tensor& got,
    const at::Tensor& expected,
    double tolerance,
    const std::string& what) {
  if (!expected.defined()) {
    EXPECT_FALSE(got.defined()) << what << " should have no gradient";
    return;
  }
  ASSERT_TRUE(got.defined()) << what << " has no gradient";
  // Sparse stays sparse, and dense dense: the layout is part of the result.
  ASSERT_EQ(got.layout(), expected.layout()) << what;
  if (expected.is_sparse()) {
    // Duplicate entries may come in another order; their sums may not.
    expectGradient(got.to_dense(), expected.to_dense(), tolerance, what);
    return;
  }
  if (tolerance == 0) {
    EXPECT_TRUE(at::equal(got, expected))
        << what << ": got " << got << " expected " << expected;
  } else {
    EXPECT_TRUE(at::allclose(got, expected, tolerance, tolerance))
        << what << ": got " << got << " expected " << expected;
  }
}

// Runs the zoo's steps in this process: "worker" r is the r-th LocalNet.
class LocalWorld {
 public:
  explicit LocalWorld(int size) {
    for (int rank = 0; rank < size; ++rank) {
      nets_.push_back(std::make_unique<LocalNet>(*this, rank));
    }
  }
  Net& net(int rank) {
    return *nets_.at(rank);
  }

  // The local reference: the gradients of `params` after the case's passes.
  std::vector<at::Tensor> gradients(const Case& c) {
    Roots roots = c.program(net(0));
    std::vector<at::Tensor> leaves;
    for (const auto& p : c.params) {
      leaves.push_back(net(p.first).param(p.second));
    }
    std::vector<at::Tensor> sums(leaves.size());
    for (int pass = 0; pass < c.passes; ++pass) {
      auto grads = torch::autograd::grad(
          roots.roots,
          leaves,
          roots.grads,
          /*retain_graph=*/pass + 1 < c.passes,
          /*create_graph=*/false,
          /*allow_unused=*/true);
      for (size_t i = 0; i < grads.size(); ++i) {
        if (grads[i].defined()) {
          sums[i] = sums[i].defined() ? sums[i] + grads[i] : grads[i];
        }
      }
    }
    return sums;
  }

 private:
  class LocalNet : public Net {
   public:
    LocalNet(LocalWorld& world, int rank) : world_(world), rank_(rank) {}
    int rank() const override {
      return rank_;
    }
    std::vector<at::Tensor> run(
        int rank,
        const std::string& op,
        std::vector<at::Tensor> inputs,
        std::vector<int64_t> path = {}) override {
      const auto& name = op == "relay_async" ? std::string("relay") : op;
      return ops().at(name)(world_.net(rank), std::move(inputs), path);
    }

   private:
    LocalWorld& world_;
    const int rank_;
  };

  std::vector<std::unique_ptr<LocalNet>> nets_;
};

} // namespace zoo
} // namespace testing
} // namespace torchrpc
