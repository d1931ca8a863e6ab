#pragma once

// The distributed side of the autograd zoo (tests/support/autograd_zoo.h):
// each worker runs the zoo's ops as registered functions on its own
// parameters, and answers for their gradients in a context.

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tests/support/autograd_zoo.h"
#include "torchrpc/autograd/backward.h"
#include "torchrpc/autograd/context_container.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace testing {
namespace zoo {

class DistNet : public Net {
 public:
  explicit DistNet(rpc::Runtime& runtime) : runtime_(runtime) {}
  int rank() const override {
    return static_cast<int>(runtime_.self().id);
  }
  std::vector<at::Tensor> run(
      int rank,
      const std::string& op,
      std::vector<at::Tensor> inputs,
      std::vector<int64_t> path = {}) override {
    if (rank == this->rank() && op != "relay_async") {
      return ops().at(op)(*this, std::move(inputs), std::move(path));
    }
    return runtime_.rpcSync<std::vector<at::Tensor>>(
        rank,
        op,
        std::move(inputs),
        std::move(path));
  }

  // This worker's gradients of `names` in the context the calling thread's
  // request belongs to (undefined where there is none).
  std::vector<at::Tensor> gradients(
      int64_t contextId,
      const std::vector<std::string>& names) {
    auto all = autograd::getGradients(runtime_, contextId);
    std::vector<at::Tensor> out;
    for (const auto& name : names) {
      auto param = findParam(name);
      out.push_back(
          param.defined() && all.contains(param) ? all.at(param)
                                                 : at::Tensor());
    }
    return out;
  }

 private:
  rpc::Runtime& runtime_;
};

// Registers the zoo's ops on `runtime` (before start()), run by `net`.
inline void registerZoo(
    rpc::Runtime& runtime,
    const std::shared_ptr<DistNet>& net) {
  for (const auto& entry : ops()) {
    Op op = entry.second;
    runtime.functions().add(
        entry.first,
        [net, op](std::vector<at::Tensor> in, std::vector<int64_t> path) {
          return op(*net, std::move(in), std::move(path));
        });
  }
  // "relay" whose nested call continues asynchronously: the handler returns
  // a future and parks no thread.
  rpc::Runtime* rt = &runtime;
  runtime.functions().add(
      "relay_async",
      [net, rt](std::vector<at::Tensor> in, std::vector<int64_t> path)
          -> rpc::Future<std::vector<at::Tensor>> {
        auto u = in.at(0) * net->param("w");
        std::vector<int64_t> rest(path.begin() + 1, path.end());
        return rt
            ->rpcAsync<std::vector<at::Tensor>>(
                path.at(0),
                "relay",
                std::vector<at::Tensor>{u},
                rest)
            .then([u](std::vector<at::Tensor> v) {
              return std::vector<at::Tensor>{relayFinish(u, v.at(0))};
            });
      });
  // Gradients as a list of tensors or None, for the multi-process tier.
  runtime.functions().add(
      "zoo_gradients",
      [net, rt](std::vector<std::string> names) -> c10::IValue {
        auto container = autograd::ContextContainer::of(*rt);
        c10::impl::GenericList out(c10::OptionalType::ofTensor());
        for (auto& grad :
             net->gradients(container->currentContextId(), names)) {
          out.push_back(grad.defined() ? c10::IValue(grad) : c10::IValue());
        }
        return out;
      });
}

} // namespace zoo
} // namespace testing
} // namespace torchrpc
