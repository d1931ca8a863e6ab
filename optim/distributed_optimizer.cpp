#include "torchrpc/optim/distributed_optimizer.h"

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <utility>

#include "torchrpc/optim/detail/local_optimizer.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/tracing.h"

namespace torchrpc {
namespace optim {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;
using Local = c10::intrusive_ptr<detail::LocalOptimizer>;

namespace {

constexpr const char* kFormatKey = "torchrpc.format";
constexpr const char* kFormat = "torchrpc.DistributedOptimizer/1";
constexpr const char* kKindKey = "torchrpc.kind";
constexpr const char* kOwnersKey = "torchrpc.owners";

std::string partKey(size_t index) {
  return "owner." + std::to_string(index);
}

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& name : names) {
    out += (out.empty() ? "" : ", ") + name;
  }
  return out.empty() ? "none" : out;
}

// Waits for every future, then throws the first error (all have settled, so
// nothing is left running behind the throw).
std::vector<c10::IValue> waitAll(const std::vector<FuturePtr>& futures) {
  rpc::allSettled(futures)->wait();
  std::vector<c10::IValue> values;
  for (const auto& future : futures) {
    if (future->hasError()) {
      std::rethrow_exception(future->exception_ptr());
    }
    values.push_back(future->value());
  }
  return values;
}

} // namespace

struct DistributedOptimizer::OwnerPart {
  std::string worker;
  rref::RRef<Local> local;
  size_t parameterCount = 0;
};

DistributedOptimizer::DistributedOptimizer(
    rpc::Runtime& runtime,
    const std::vector<rref::RRef<at::Tensor>>& parameters,
    const OptimizerOptions& options)
    : runtime_(runtime),
      selfName_(runtime.self().name),
      kind_(options.kind()),
      learningRate_(options.learningRate()) {
  TORCH_CHECK(
      !parameters.empty(),
      "a DistributedOptimizer needs parameters to step");
  // The worker that steps arms the trace window (Note [Tracing]): before
  // its first step, so that a window from step 0 has all of it.
  const rpc::Options& runtimeOptions = runtime.options();
  if (!runtimeOptions.traceDirectory.empty() &&
      runtimeOptions.traceStepCount > 0) {
    runtime.tracer().traceSteps(
        runtimeOptions.traceFirstStep,
        runtimeOptions.traceStepCount);
  }
  // Group by owner, in the order owners first appear.
  std::vector<std::string> owners;
  std::vector<std::vector<rref::RRef<at::Tensor>>> byOwner;
  for (const auto& parameter : parameters) {
    TORCH_CHECK(parameter.defined(), "a parameter RRef is empty");
    size_t index = 0;
    while (index < owners.size() && owners[index] != parameter.ownerName()) {
      ++index;
    }
    if (index == owners.size()) {
      owners.push_back(parameter.ownerName());
      byOwner.emplace_back();
    }
    byOwner[index].push_back(parameter);
  }
  std::vector<FuturePtr> created;
  for (size_t i = 0; i < owners.size(); ++i) {
    auto part = std::make_shared<OwnerPart>();
    part->worker = owners[i];
    part->parameterCount = byOwner[i].size();
    part->local = rref::remote<Local>(
        runtime,
        owners[i],
        detail::kCreate,
        options.kind(),
        options.values(),
        byOwner[i]);
    created.push_back(part->local.confirmedAsync().ivalue());
    parts_.push_back(std::move(part));
  }
  waitAll(created);
}

DistributedOptimizer::~DistributedOptimizer() = default;

std::vector<FuturePtr> DistributedOptimizer::onEveryOwner(
    const std::function<FuturePtr(const OwnerPart&)>& call) const {
  std::vector<FuturePtr> futures;
  futures.reserve(parts_.size());
  for (const auto& part : parts_) {
    futures.push_back(call(*part));
  }
  return futures;
}

rpc::Future<void> DistributedOptimizer::stepAsync(int64_t contextId) {
  const auto startedAt = std::chrono::steady_clock::now();
  const bool traced = runtime_.tracer().enabled();
  auto futures = onEveryOwner([contextId](const OwnerPart& part) {
    return part.local.rpcAsync<int64_t>(detail::kStep, contextId).ivalue();
  });
  // The step's end for trace windows (Note [Tracing] in rpc/tracing.h):
  // its messages above are the step's last.
  runtime_.step();
  std::vector<std::string> workers;
  for (const auto& part : parts_) {
    workers.push_back(part->worker);
  }
  auto done = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
  if (traced) {
    rpc::Tracer& tracer = runtime_.tracer();
    size_t owners = parts_.size();
    done->addCallback(
        [&tracer, startedAt, contextId, owners](c10::ivalue::Future& step) {
          rpc::TraceArgs args = {
              {"context", contextId},
              {"owners", static_cast<int64_t>(owners)}};
          if (step.hasError()) {
            args.emplace_back(
                "error",
                rpc::describeException(step.exception_ptr()));
          }
          tracer.complete(
              "optim",
              "DistributedOptimizer.step (context " +
                  std::to_string(contextId) + ")",
              startedAt,
              std::chrono::steady_clock::now(),
              std::move(args));
        });
  }
  auto settled = rpc::allSettled(futures);
  settled->addCallback([done, futures, workers, contextId, self = selfName_](
                           c10::ivalue::Future&) {
    std::vector<std::string> applied;
    std::vector<std::string> failed;
    std::exception_ptr firstError;
    int64_t updated = 0;
    for (size_t i = 0; i < futures.size(); ++i) {
      if (futures[i]->hasError()) {
        failed.push_back(workers[i]);
        if (!firstError) {
          firstError = futures[i]->exception_ptr();
        }
      } else {
        applied.push_back(workers[i]);
        updated += futures[i]->value().toInt();
      }
    }
    const std::string function = "DistributedOptimizer.step";
    if (firstError) {
      std::string where = " (the step of context " + std::to_string(contextId) +
          " was applied on: " + joined(applied) +
          "; not applied on: " + joined(failed) + ")";
      try {
        std::rethrow_exception(firstError);
      } catch (const rpc::RpcError& error) {
        done->setError(rpc::makeRpcError(
            error.code(),
            error.worker(),
            function,
            error.messageId(),
            error.detail() + where));
      } catch (...) {
        done->setError(rpc::makeRpcError(
            rpc::ErrorCode::kRemoteException,
            failed.front(),
            function,
            0,
            rpc::describeException(firstError) + where));
      }
      return;
    }
    if (updated == 0) {
      done->setError(rpc::makeRpcError(
          rpc::ErrorCode::kBadArguments,
          self,
          function,
          0,
          "context " + std::to_string(contextId) +
              " has no gradient for any parameter of this optimizer on " +
              joined(workers) + " (did a backward pass run in it?)"));
      return;
    }
    done->markCompleted(c10::IValue());
  });
  return rpc::Future<void>(done, selfName_, "DistributedOptimizer.step");
}

void DistributedOptimizer::step(int64_t contextId) {
  stepAsync(contextId).wait();
}

void DistributedOptimizer::setLearningRate(double lr) {
  TORCH_CHECK(lr >= 0, "a learning rate must be >= 0, got ", lr);
  waitAll(onEveryOwner([lr](const OwnerPart& part) {
    return part.local.rpcAsync<void>(detail::kSetLearningRate, lr).ivalue();
  }));
  learningRate_ = lr;
}

void DistributedOptimizer::save(const std::string& path) const {
  auto states = waitAll(onEveryOwner([](const OwnerPart& part) {
    return part.local.rpcAsync<at::Tensor>(detail::kStateBytes).ivalue();
  }));
  torch::serialize::OutputArchive archive;
  archive.write(kFormatKey, c10::IValue(std::string(kFormat)));
  archive.write(kKindKey, c10::IValue(kind_));
  c10::List<std::string> owners;
  for (const auto& part : parts_) {
    owners.push_back(part->worker);
  }
  archive.write(kOwnersKey, c10::IValue(owners));
  for (size_t i = 0; i < states.size(); ++i) {
    archive.write(partKey(i), states[i].toTensor());
  }
  archive.save_to(path);
}

void DistributedOptimizer::load(const std::string& path) {
  torch::serialize::InputArchive archive;
  archive.load_from(path);
  c10::IValue format;
  TORCH_CHECK(
      archive.try_read(kFormatKey, format) && format.isString() &&
          format.toStringRef() == kFormat,
      "'",
      path,
      "' is not a DistributedOptimizer checkpoint");
  c10::IValue kind;
  archive.read(kKindKey, kind);
  TORCH_CHECK(
      kind.toStringRef() == kind_,
      "'",
      path,
      "' holds the state of a ",
      kind.toStringRef(),
      " optimizer; this one runs ",
      kind_);
  c10::IValue ownersValue;
  archive.read(kOwnersKey, ownersValue);
  std::vector<std::string> saved;
  for (const auto& owner : ownersValue.toListRef()) {
    saved.push_back(owner.toStringRef());
  }
  TORCH_CHECK(
      saved.size() == parts_.size(),
      "'",
      path,
      "' holds the state of ",
      saved.size(),
      " owner(s) (",
      joined(saved),
      "); this optimizer has ",
      parts_.size(),
      " (",
      joined(owners()),
      ")");
  std::vector<at::Tensor> states(parts_.size());
  for (size_t i = 0; i < parts_.size(); ++i) {
    archive.read(partKey(i), states[i]);
  }
  size_t index = 0;
  auto rates = waitAll(onEveryOwner([&](const OwnerPart& part) {
    return part.local.rpcAsync<double>(detail::kLoadBytes, states[index++])
        .ivalue();
  }));
  learningRate_ = rates.front().toDouble();
}

void DistributedOptimizer::saveOnOwners(const std::string& prefix) const {
  waitAll(onEveryOwner([&prefix](const OwnerPart& part) {
    return part.local
        .rpcAsync<void>(detail::kSaveFile, prefix + part.worker + ".pt")
        .ivalue();
  }));
}

void DistributedOptimizer::loadOnOwners(const std::string& prefix) {
  auto rates = waitAll(onEveryOwner([&prefix](const OwnerPart& part) {
    return part.local
        .rpcAsync<double>(detail::kLoadFile, prefix + part.worker + ".pt")
        .ivalue();
  }));
  learningRate_ = rates.front().toDouble();
}

std::vector<std::string> DistributedOptimizer::owners() const {
  std::vector<std::string> out;
  for (const auto& part : parts_) {
    out.push_back(part->worker);
  }
  return out;
}

std::vector<int64_t> DistributedOptimizer::stepCounts() const {
  auto counts = waitAll(onEveryOwner([](const OwnerPart& part) {
    return part.local.rpcAsync<int64_t>(detail::kStepCount).ivalue();
  }));
  std::vector<int64_t> out;
  for (const auto& count : counts) {
    out.push_back(count.toInt());
  }
  return out;
}

void setParameter(
    rpc::Runtime& runtime,
    const rref::RRef<at::Tensor>& parameter,
    const at::Tensor& value) {
  runtime.rpcSync<void>(
      parameter.ownerName(),
      detail::kSetParameter,
      parameter,
      value);
}

void installOwnerSide(rpc::Runtime& runtime) {
  detail::registerOwnerFunctions(runtime);
}

} // namespace optim
} // namespace torchrpc
