#include "torchrpc/optim/detail/local_optimizer.h"

#include <ATen/core/Dict.h>
#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <cstring>
#include <fstream>
#include <iterator>
#include <utility>

#include "torchrpc/rpc/tracing.h"

namespace torchrpc {
namespace optim {
namespace detail {

namespace {

// The custom class makes c10::intrusive_ptr<LocalOptimizer> a value type:
// an RRef can hold it, and only its owner ever sees the object.
const auto kRegistration =
    torch::class_<LocalOptimizer>("torchrpc", "LocalOptimizer");

constexpr const char* kKindKey = "torchrpc.kind";
constexpr const char* kShapesKey = "torchrpc.shapes";
constexpr const char* kStepsKey = "torchrpc.steps";

} // namespace

LocalOptimizer::LocalOptimizer(
    std::weak_ptr<autograd::ContextContainer> container,
    const OptimizerOptions& options,
    std::vector<rref::RRef<at::Tensor>> parameters)
    : container_(std::move(container)),
      kind_(options.kind()),
      parameters_(std::move(parameters)) {
  auto layer = container_.lock();
  TORCH_CHECK(layer, "the runtime is gone");
  std::vector<at::Tensor> values;
  for (const auto& parameter : parameters_) {
    TORCH_CHECK(
        parameter.isOwner(),
        "a LocalOptimizer takes the parameters its worker owns");
    at::Tensor value = parameter.localValue();
    TORCH_CHECK(
        value.is_floating_point() || value.is_complex(),
        "an optimizer steps floating-point parameters, got one of dtype ",
        value.scalar_type());
    slots_.push_back(layer->parameterVersions().slotOf(value));
    values.push_back(value);
  }
  optimizer_ = std::make_unique<FlatOptimizer>(options, values);
  published_ = std::move(values);
}

int64_t LocalOptimizer::step(int64_t contextId) {
  auto layer = container_.lock();
  TORCH_CHECK(layer, "the runtime is gone");
  auto context = layer->find(contextId);
  if (!context) {
    return 0;
  }
  auto& versions = layer->parameterVersions();
  auto gradients = versions.bySlot(context->gradients());

  std::lock_guard<std::mutex> guard(mutex_);
  // Steps on one worker never interleave: two trainers' updates of a shared
  // parameter are applied one after the other, none lost.
  auto updates = versions.lockUpdates();
  const auto& copies = optimizer_->parameters();
  std::vector<at::Tensor> stepGradients(parameters_.size());
  std::vector<at::Tensor> current(parameters_.size());
  for (size_t i = 0; i < parameters_.size(); ++i) {
    auto it = gradients.find(slots_[i]);
    if (it == gradients.end()) {
      continue;
    }
    current[i] = parameters_[i].localValue();
    if (!current[i].is_same(published_[i])) {
      at::NoGradGuard noGrad;
      copies[i].copy_(current[i]);
    }
    stepGradients[i] = it->second;
  }
  if (optimizer_->step(stepGradients) == 0) {
    return 0;
  }
  int64_t stepped = 0;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (!stepGradients[i].defined()) {
      continue;
    }
    at::Tensor version = optimizer_->copyOf(i);
    version.set_requires_grad(current[i].requires_grad());
    // The parameter's .grad is left as it was.
    if (current[i].grad().defined()) {
      version.mutable_grad() = current[i].grad();
    }
    versions.add(slots_[i], version);
    parameters_[i].setLocalValue(version);
    published_[i] = std::move(version);
    ++stepped;
  }
  ++steps_;
  return stepped;
}

void LocalOptimizer::setLearningRate(double lr) {
  TORCH_CHECK(lr >= 0, "a learning rate must be >= 0, got ", lr);
  std::lock_guard<std::mutex> guard(mutex_);
  optimizer_->setLearningRate(lr);
}

void LocalOptimizer::writeArchive(torch::serialize::OutputArchive& archive) {
  optimizer_->save(archive);
  archive.write(kKindKey, c10::IValue(kind_));
  c10::List<std::vector<int64_t>> shapes;
  for (const auto& copy : optimizer_->parameters()) {
    shapes.push_back(copy.sizes().vec());
  }
  archive.write(kShapesKey, c10::IValue(shapes));
  archive.write(kStepsKey, c10::IValue(steps_));
}

std::string LocalOptimizer::save() {
  std::lock_guard<std::mutex> guard(mutex_);
  torch::serialize::OutputArchive archive;
  writeArchive(archive);
  std::string bytes;
  archive.save_to([&bytes](const void* data, size_t size) {
    bytes.append(static_cast<const char*>(data), size);
    return size;
  });
  return bytes;
}

double LocalOptimizer::load(const char* data, size_t size) {
  torch::serialize::InputArchive archive;
  archive.load_from(data, size);
  c10::IValue kind;
  TORCH_CHECK(
      archive.try_read(kKindKey, kind) && kind.isString(),
      "not a torchrpc optimizer checkpoint (no '",
      kKindKey,
      "')");
  TORCH_CHECK(
      kind.toStringRef() == kind_,
      "the checkpoint holds ",
      kind.toStringRef(),
      " state; this optimizer runs ",
      kind_);
  c10::IValue shapes;
  archive.read(kShapesKey, shapes);
  auto saved = shapes.toList();
  const auto& copies = optimizer_->parameters();
  TORCH_CHECK(
      saved.size() == copies.size(),
      "the checkpoint holds the state of ",
      saved.size(),
      " parameter(s); this optimizer has ",
      copies.size(),
      " here");
  for (size_t i = 0; i < copies.size(); ++i) {
    auto shape = c10::IValue(saved.get(i)).toIntVector();
    TORCH_CHECK(
        copies[i].sizes().vec() == shape,
        "parameter ",
        i,
        " has shape ",
        copies[i].sizes(),
        " here; the checkpoint's has shape ",
        c10::IntArrayRef(shape));
  }
  c10::IValue steps;
  archive.read(kStepsKey, steps);

  std::lock_guard<std::mutex> guard(mutex_);
  optimizer_->load(archive);
  steps_ = steps.toInt();
  return optimizer_->learningRate();
}

int64_t LocalOptimizer::stepCount() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return steps_;
}

void registerOwnerFunctions(rpc::Runtime& runtime) {
  using Local = c10::intrusive_ptr<LocalOptimizer>;
  auto& functions = runtime.functions();
  if (functions.find(kCreate)) {
    return;
  }
  std::weak_ptr<autograd::ContextContainer> container =
      autograd::ContextContainer::of(runtime);
  functions.add(
      kCreate,
      [container](
          std::string kind,
          c10::Dict<std::string, double> values,
          std::vector<rref::RRef<at::Tensor>> parameters) {
        return c10::make_intrusive<LocalOptimizer>(
            container,
            OptimizerOptions::fromWire(kind, values),
            std::move(parameters));
      });
  functions.add(kStep, [&runtime](Local local, int64_t contextId) {
    rpc::TraceSpan span(runtime.tracer(), "optim");
    if (span) {
      span.name(
          "optimizer step on " + runtime.self().name + " (context " +
          std::to_string(contextId) + ")");
      span.arg("context", contextId);
    }
    return local->step(contextId);
  });
  functions.add(kSetLearningRate, [](Local local, double lr) {
    local->setLearningRate(lr);
  });
  functions.add(kStateBytes, [](Local local) {
    std::string bytes = local->save();
    auto out = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(out.data_ptr(), bytes.data(), bytes.size());
    return out;
  });
  functions.add(kLoadBytes, [](Local local, at::Tensor bytes) {
    TORCH_CHECK(
        bytes.scalar_type() == at::kByte && bytes.dim() == 1,
        "optimizer state travels as a 1-d uint8 tensor");
    bytes = bytes.contiguous();
    return local->load(
        static_cast<const char*>(bytes.data_ptr()),
        static_cast<size_t>(bytes.numel()));
  });
  functions.add(kSaveFile, [](Local local, std::string path) {
    std::string bytes = local->save();
    std::ofstream file(path, std::ios::binary | std::ios::trunc);
    file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    file.close();
    TORCH_CHECK(file, "cannot write '", path, "'");
  });
  functions.add(kLoadFile, [](Local local, std::string path) {
    std::ifstream file(path, std::ios::binary);
    TORCH_CHECK(file, "cannot read '", path, "'");
    std::string bytes(
        (std::istreambuf_iterator<char>(file)),
        std::istreambuf_iterator<char>());
    TORCH_CHECK(!file.bad(), "cannot read '", path, "'");
    return local->load(bytes.data(), bytes.size());
  });
  functions.add(kStepCount, [](Local local) { return local->stepCount(); });
  functions.add(
      kSetParameter,
      [container](rref::RRef<at::Tensor> parameter, at::Tensor value) {
        auto layer = container.lock();
        TORCH_CHECK(layer, "the runtime is gone");
        at::Tensor current = parameter.localValue();
        TORCH_CHECK(
            value.sizes() == current.sizes() &&
                value.scalar_type() == current.scalar_type(),
            "the parameter is a ",
            current.scalar_type(),
            " tensor of shape ",
            current.sizes(),
            "; the new value is a ",
            value.scalar_type(),
            " tensor of shape ",
            value.sizes());
        auto& versions = layer->parameterVersions();
        auto updates = versions.lockUpdates();
        at::Tensor version = value.detach().to(current.device()).clone();
        version.set_requires_grad(current.requires_grad());
        versions.add(versions.slotOf(current), version);
        parameter.setLocalValue(version);
      });
}

} // namespace detail
} // namespace optim
} // namespace torchrpc
