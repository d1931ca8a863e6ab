#pragma once

// The model the parameter server holds: an MLP 784-256-10.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <string>

#include "fashion_mnist.h"

namespace torchrpc {
namespace rpc {
class Runtime;
} // namespace rpc
} // namespace torchrpc

namespace ps {

class Mlp : public torch::nn::Module {
 public:
  // Initialized from `seed` (libtorch's default initialization), so every
  // run with the same seed starts from the same parameters.
  Mlp(int64_t hidden, int64_t seed);

  // Logits of a [N, 784] batch.
  at::Tensor forward(at::Tensor images);

 private:
  torch::nn::Linear fc1_{nullptr};
  torch::nn::Linear fc2_{nullptr};
};

// The name the server registers the model under (registerModuleFactory).
constexpr const char* kMlpType = "ps.Mlp";

// Makes the model creatable on `runtime` (before start()).
void registerModel(torchrpc::rpc::Runtime& runtime);

// Accuracy in [0, 1] of `model` on `examples`, without autograd.
double accuracy(Mlp& model, const Examples& examples);

} // namespace ps
