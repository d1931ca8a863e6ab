#include "torchrpc/optim/optimizer_options.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <tuple>
#include <utility>

namespace torchrpc {
namespace optim {

namespace {

// The option names of each kind, in libtorch's words.
const std::vector<std::string>& namesOf(const std::string& kind) {
  static const std::vector<std::string> sgd{
      "lr",
      "momentum",
      "dampening",
      "weight_decay",
      "nesterov"};
  static const std::vector<std::string>
      adam{"lr", "betas.0", "betas.1", "eps", "weight_decay", "amsgrad"};
  static const std::vector<std::string> adagrad{
      "lr",
      "lr_decay",
      "weight_decay",
      "initial_accumulator_value",
      "eps"};
  static const std::vector<std::string>
      rmsprop{"lr", "alpha", "eps", "weight_decay", "momentum", "centered"};
  if (kind == "SGD") {
    return sgd;
  }
  if (kind == "Adam" || kind == "AdamW") {
    return adam;
  }
  if (kind == "Adagrad") {
    return adagrad;
  }
  TORCH_CHECK(
      kind == "RMSprop",
      "unknown optimizer kind '",
      kind,
      "' (known: SGD, Adam, AdamW, Adagrad, RMSprop)");
  return rmsprop;
}

c10::Dict<std::string, double> dictOf(
    std::initializer_list<std::pair<const char*, double>> entries) {
  c10::Dict<std::string, double> out;
  for (const auto& entry : entries) {
    out.insert(entry.first, entry.second);
  }
  return out;
}

// Adam and AdamW have the same options (they differ in how the step applies
// weight decay).
template <typename AdamLike>
c10::Dict<std::string, double> adamValues(const AdamLike& o) {
  return dictOf(
      {{"lr", o.lr()},
       {"betas.0", std::get<0>(o.betas())},
       {"betas.1", std::get<1>(o.betas())},
       {"eps", o.eps()},
       {"weight_decay", o.weight_decay()},
       {"amsgrad", o.amsgrad() ? 1.0 : 0.0}});
}

bool flag(const c10::Dict<std::string, double>& values, const char* name) {
  return values.at(name) != 0.0;
}

template <typename AdamLike>
AdamLike adamOptions(const c10::Dict<std::string, double>& v) {
  return AdamLike(v.at("lr"))
      .betas(std::make_tuple(v.at("betas.0"), v.at("betas.1")))
      .eps(v.at("eps"))
      .weight_decay(v.at("weight_decay"))
      .amsgrad(flag(v, "amsgrad"));
}

} // namespace

OptimizerOptions::OptimizerOptions(
    std::string kind,
    c10::Dict<std::string, double> values)
    : kind_(std::move(kind)),
      values_(std::move(values)) {}

OptimizerOptions::OptimizerOptions(const torch::optim::SGDOptions& o)
    : OptimizerOptions(
          "SGD",
          dictOf(
              {{"lr", o.lr()},
               {"momentum", o.momentum()},
               {"dampening", o.dampening()},
               {"weight_decay", o.weight_decay()},
               {"nesterov", o.nesterov() ? 1.0 : 0.0}})) {}

OptimizerOptions::OptimizerOptions(const torch::optim::AdamOptions& o)
    : OptimizerOptions("Adam", adamValues(o)) {}

OptimizerOptions::OptimizerOptions(const torch::optim::AdamWOptions& o)
    : OptimizerOptions("AdamW", adamValues(o)) {}

OptimizerOptions::OptimizerOptions(const torch::optim::AdagradOptions& o)
    : OptimizerOptions(
          "Adagrad",
          dictOf(
              {{"lr", o.lr()},
               {"lr_decay", o.lr_decay()},
               {"weight_decay", o.weight_decay()},
               {"initial_accumulator_value", o.initial_accumulator_value()},
               {"eps", o.eps()}})) {}

OptimizerOptions::OptimizerOptions(const torch::optim::RMSpropOptions& o)
    : OptimizerOptions(
          "RMSprop",
          dictOf(
              {{"lr", o.lr()},
               {"alpha", o.alpha()},
               {"eps", o.eps()},
               {"weight_decay", o.weight_decay()},
               {"momentum", o.momentum()},
               {"centered", o.centered() ? 1.0 : 0.0}})) {}

OptimizerOptions::OptimizerOptions(const torch::optim::LBFGSOptions&) {
  TORCH_CHECK(
      false,
      "DistributedOptimizer cannot run LBFGS: its step re-evaluates the loss "
      "through a closure several times per step, and a distributed step has "
      "no loss to re-evaluate on the workers that own the parameters. Use "
      "SGD, Adam, AdamW, Adagrad or RMSprop");
}

double OptimizerOptions::learningRate() const {
  return values_.at("lr");
}

OptimizerOptions OptimizerOptions::fromWire(
    const std::string& kind,
    const c10::Dict<std::string, double>& values) {
  const auto& names = namesOf(kind);
  for (const auto& entry : values) {
    TORCH_CHECK(
        std::find(names.begin(), names.end(), entry.key()) != names.end(),
        kind,
        " has no option '",
        entry.key(),
        "'");
    TORCH_CHECK(
        std::isfinite(entry.value()),
        kind,
        " option '",
        entry.key(),
        "' is not finite");
  }
  for (const auto& name : names) {
    TORCH_CHECK(values.contains(name), kind, " option '", name, "' is missing");
  }
  TORCH_CHECK(values.at("lr") >= 0, kind, " needs lr >= 0");
  return OptimizerOptions(kind, values.copy());
}

std::unique_ptr<torch::optim::Optimizer> OptimizerOptions::make(
    std::vector<at::Tensor> parameters) const {
  const auto& v = values_;
  if (kind_ == "SGD") {
    return std::make_unique<torch::optim::SGD>(
        std::move(parameters),
        torch::optim::SGDOptions(v.at("lr"))
            .momentum(v.at("momentum"))
            .dampening(v.at("dampening"))
            .weight_decay(v.at("weight_decay"))
            .nesterov(flag(v, "nesterov")));
  }
  if (kind_ == "Adam") {
    return std::make_unique<torch::optim::Adam>(
        std::move(parameters),
        adamOptions<torch::optim::AdamOptions>(v));
  }
  if (kind_ == "AdamW") {
    return std::make_unique<torch::optim::AdamW>(
        std::move(parameters),
        adamOptions<torch::optim::AdamWOptions>(v));
  }
  if (kind_ == "Adagrad") {
    return std::make_unique<torch::optim::Adagrad>(
        std::move(parameters),
        torch::optim::AdagradOptions(v.at("lr"))
            .lr_decay(v.at("lr_decay"))
            .weight_decay(v.at("weight_decay"))
            .initial_accumulator_value(v.at("initial_accumulator_value"))
            .eps(v.at("eps")));
  }
  TORCH_CHECK(kind_ == "RMSprop", "unknown optimizer kind '", kind_, "'");
  return std::make_unique<torch::optim::RMSprop>(
      std::move(parameters),
      torch::optim::RMSpropOptions(v.at("lr"))
          .alpha(v.at("alpha"))
          .eps(v.at("eps"))
          .weight_decay(v.at("weight_decay"))
          .momentum(v.at("momentum"))
          .centered(flag(v, "centered")));
}

} // namespace optim
} // namespace torchrpc
