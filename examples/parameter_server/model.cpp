#include "model.h"

#include <torch/nn/functional/activation.h>
#include <torch/torch.h>
#include <torchrpc/torchrpc.h>

#include <memory>

namespace ps {

Mlp::Mlp(int64_t hidden, int64_t seed) {
  // NB: the global generator; creation happens on the server's pool while
  // nothing else there draws random numbers.
  torch::manual_seed(seed);
  fc1_ = register_module("fc1", torch::nn::Linear(784, hidden));
  fc2_ = register_module("fc2", torch::nn::Linear(hidden, 10));
}

at::Tensor Mlp::forward(at::Tensor images) {
  return fc2_->forward(at::relu(fc1_->forward(images)));
}

void registerModel(torchrpc::rpc::Runtime& runtime) {
  torchrpc::nn::registerModuleFactory<Mlp>(
      runtime,
      kMlpType,
      [](int64_t hidden, int64_t seed) {
        return std::make_shared<Mlp>(hidden, seed);
      });
}

double accuracy(Mlp& model, const Examples& examples) {
  at::NoGradGuard noGrad;
  int64_t correct = 0;
  for (int64_t start = 0; start < examples.size(); start += 1000) {
    int64_t end = std::min(examples.size(), start + 1000);
    at::Tensor logits = model.forward(examples.images.slice(0, start, end));
    correct += logits.argmax(1)
                   .eq(examples.labels.slice(0, start, end))
                   .sum()
                   .item<int64_t>();
  }
  return examples.size() == 0 ? 0.0 : double(correct) / examples.size();
}

} // namespace ps
