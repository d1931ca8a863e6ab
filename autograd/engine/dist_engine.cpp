#include "torchrpc/autograd/engine/dist_engine.h"

#include <ATen/ATen.h>
#include <ATen/core/List.h>
#include <c10/core/thread_pool.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <set>
#include <sstream>

#include "proto/autograd/autograd.pb.h"
#include "torchrpc/autograd/detail/wire.h"
#include "torchrpc/autograd/messages.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/future.h"
#include "torchrpc/rpc/request_scope.h"
#include "torchrpc/rpc/tracing.h"
#include "torchrpc/rref/rref.h"

namespace torchrpc {
namespace autograd {

using detail::LocalBackward;
using detail::parseOrThrow;
using detail::passRef;
using detail::passRequest;
using rpc::failedFuture;
using rpc::readyFuture;
using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

namespace {

constexpr const char* kWhat = detail::kBackwardWhat;
constexpr int kIdShift = 48;
// How long the driver waits for answers to kAbort after a failure.
constexpr std::chrono::milliseconds kAbortTimeout{5000};

// Completes with the first error as soon as it comes, or, once all
// succeeded, with the list of `futures` (completed): c10::collectAll's
// contract. Not c10::collectAll itself, because it hands every later error
// to setErrorIfNeeded, which logs each one with the first at INFO; a
// failed pass usually fails several of its parts with the same cause (the
// remote node's error, then the local pass aborted by it), and that would
// print the cause again on the user's stderr on every failed backward.
FuturePtr firstErrorOrAll(const std::vector<FuturePtr>& futures) {
  struct State {
    explicit State(const std::vector<FuturePtr>& futures)
        : remaining(futures.size()),
          list(c10::FutureType::create(c10::AnyType::get())) {
      list.reserve(futures.size());
      for (const auto& future : futures) {
        list.push_back(future);
      }
    }
    std::atomic<size_t> remaining;
    std::atomic<bool> settled{false};
    c10::List<FuturePtr> list;
    FuturePtr all =
        c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  };
  auto state = std::make_shared<State>(futures);
  if (futures.empty()) {
    state->all->markCompleted(state->list);
    return state->all;
  }
  for (const auto& future : futures) {
    future->addCallback([state](c10::ivalue::Future& done) {
      if (done.hasError()) {
        if (!state->settled.exchange(true)) {
          state->all->setError(done.exception_ptr());
        }
        return;
      }
      if (state->remaining.fetch_sub(1) == 1 &&
          !state->settled.exchange(true)) {
        state->all->markCompleted(state->list);
      }
    });
  }
  return state->all;
}

std::string describePass(int64_t contextId, int64_t passId) {
  return "pass " + std::to_string(passId) +
      " of distributed autograd context " + std::to_string(contextId);
}

// D2': whether every RecvFunction the driver's walk reached came from
// another worker whose graph behind the send reaches no RecvFunction.
bool discoveryEndsHere(
    const DistContext& context,
    const LocalBackward::NewlyReached& reached,
    int64_t selfId) {
  for (const auto& entry : reached) {
    if (entry.first == selfId) {
      return false;
    }
    for (int64_t messageId : entry.second) {
      auto recv = context.findRecv(messageId);
      if (!recv || !recv->senderGraphIsFinal()) {
        return false;
      }
    }
  }
  return true;
}

} // namespace

DistEngine::DistEngine(rpc::Runtime& runtime, ContextTable contexts)
    : runtime_(runtime),
      agent_(runtime.agent()),
      contexts_(std::move(contexts)),
      selfId_(runtime.self().id) {}

void DistEngine::registerWithAgent() {
  std::weak_ptr<DistEngine> weak = weak_from_this();
  const std::string& selfName = runtime_.self().name;
  auto bind = [weak,
               &selfName](FuturePtr (DistEngine::*handler)(rpc::Request &&)) {
    return [weak, handler, selfName](rpc::Request&& request) -> FuturePtr {
      auto self = weak.lock();
      if (!self) {
        return failedFuture(rpc::makeRpcError(
            rpc::ErrorCode::kShuttingDown,
            selfName,
            kWhat,
            request.id,
            "the distributed autograd layer is gone"));
      }
      return ((*self).*handler)(std::move(request));
    };
  };
  agent_.registerHandler(
      kDiscoverKind,
      "autograd.discover",
      bind(&DistEngine::onDiscover));
  // Taking gradients is checks and moves, under locks that are held for
  // local work only, never while a message is awaited; and their sender
  // waits for the answer (E3). So they are taken and answered on the
  // thread that reads them, and what they make ready runs on the pool
  // (onGradients).
  agent_.registerHandler(
      kGradientsKind,
      "autograd.gradients",
      bind(&DistEngine::onGradients),
      rpc::RequestLabel::kHandlerName,
      rpc::Cancellation::kRunAnyway,
      rpc::Dispatch::kInline);
  agent_.registerHandler(
      kAwaitKind,
      "autograd.await",
      bind(&DistEngine::onAwait));
  agent_.registerHandler(
      kAbortKind,
      "autograd.abort",
      bind(&DistEngine::onAbort));
  agent_.registerHandler(
      kBackwardOnOwnerKind,
      "autograd.backwardOnOwner",
      bind(&DistEngine::onBackwardOnOwner));
}

std::string DistEngine::workerName(int64_t id) const {
  try {
    return agent_.resolve(rpc::WorkerRef(id)).name;
  } catch (const std::exception&) {
    return "worker id " + std::to_string(id);
  }
}

std::chrono::milliseconds DistEngine::deadlineOf(
    const BackwardOptions& options) const {
  return options.deadline.count() > 0 ? options.deadline
                                      : runtime_.options().defaultTimeout;
}

std::shared_ptr<DistContext> DistEngine::contextOrThrow(
    int64_t contextId) const {
  auto context = contexts_.find(contextId);
  if (!context) {
    throw rpc::RpcError(
        rpc::ErrorCode::kBadArguments,
        runtime_.self().name,
        kWhat,
        0,
        "no distributed autograd context " + std::to_string(contextId) +
            " on this worker (released, or never joined)");
  }
  return context;
}

std::shared_ptr<LocalBackward> DistEngine::findOrCreatePass(
    const std::shared_ptr<DistContext>& context,
    int64_t passId,
    bool retainGraph,
    bool holdsDeliveries) {
  if (auto existing = context->findPass(passId)) {
    return existing;
  }
  std::weak_ptr<DistEngine> weakEngine = weak_from_this();
  std::weak_ptr<DistContext> weakContext = context;
  int64_t contextId = context->id();
  // The pass reaches itself through a weak pointer: its callbacks are
  // members of it.
  auto weakPass = std::make_shared<std::weak_ptr<LocalBackward>>();
  auto pass = std::make_shared<LocalBackward>(
      contextId,
      passId,
      runtime_.self().name,
      retainGraph,
      [weakEngine, weakPass, contextId](
          const std::shared_ptr<RecvFunction>& recv,
          torch::autograd::variable_list grads) {
        auto engine = weakEngine.lock();
        auto pass = weakPass->lock();
        if (engine && pass) {
          engine->sendGradients(contextId, pass, recv, std::move(grads));
        }
      },
      [weakContext](std::vector<std::pair<at::Tensor, at::Tensor>> leaves) {
        if (auto context = weakContext.lock()) {
          context->accumulateGradients(std::move(leaves));
        }
      },
      &agent_.tracer());
  *weakPass = pass;
  if (holdsDeliveries) {
    pass->holdDeliveries();
  }
  return context->addPass(pass);
}

// ---- D1, D2, E1, E4 on the driver -------------------------------------------

namespace {

// D1: each root's gradient edge and gradient. Throws c10::Error for misuse.
std::pair<torch::autograd::edge_list, torch::autograd::variable_list> takeRoots(
    const std::vector<at::Tensor>& roots,
    const std::vector<at::Tensor>& grads) {
  TORCH_CHECK(!roots.empty(), "distributed backward needs at least one root");
  TORCH_CHECK(
      grads.empty() || grads.size() == roots.size(),
      "distributed backward got ",
      roots.size(),
      " roots and ",
      grads.size(),
      " gradients");
  torch::autograd::edge_list edges;
  torch::autograd::variable_list rootGrads;
  for (size_t i = 0; i < roots.size(); ++i) {
    const auto& root = roots[i];
    TORCH_CHECK(root.defined(), "root ", i, " of backward is undefined");
    TORCH_CHECK(
        root.requires_grad(),
        "root ",
        i,
        " of backward does not require grad and has no grad_fn");
    // As PyTorch's distributed engine: a leaf root would only hand its own
    // gradient (ones) to itself.
    TORCH_CHECK(
        root.grad_fn(),
        "root ",
        i,
        " of backward is a leaf tensor: it does not have a valid gradient "
        "function");
    at::Tensor grad = grads.empty() ? at::Tensor() : grads[i];
    if (grad.defined()) {
      TORCH_CHECK(
          grad.sizes() == root.sizes(),
          "the gradient of root ",
          i,
          " has sizes ",
          grad.sizes(),
          " but the root has sizes ",
          root.sizes());
      grad = grad.detach();
    } else {
      TORCH_CHECK(
          root.numel() == 1,
          "root ",
          i,
          " has ",
          root.numel(),
          " elements: pass its gradient (it is implicit only for "
          "one-element roots)");
      grad = at::ones_like(root, at::MemoryFormat::Preserve);
    }
    edges.push_back(torch::autograd::impl::gradient_edge(root));
    rootGrads.push_back(std::move(grad));
  }
  return {std::move(edges), std::move(rootGrads)};
}

} // namespace

struct DistEngine::DrivenPass {
  std::weak_ptr<DistEngine> engine;
  std::weak_ptr<DistContext> context;
  int64_t contextId = 0;
  int64_t passId = 0;
  std::chrono::milliseconds deadline{0};
  std::chrono::steady_clock::time_point startedAt;
  // Completes when the pass has ended here and everywhere.
  FuturePtr result =
      c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
  // The other workers the pass reached (set once discovery answered).
  std::vector<int64_t> workers;

  // What is left of the deadline (at least 1 ms).
  std::chrono::milliseconds remaining() const {
    auto left = deadline -
        std::chrono::duration_cast<std::chrono::milliseconds>(
                    std::chrono::steady_clock::now() - startedAt);
    return std::max(left, std::chrono::milliseconds(1));
  }

  // E4: the first error ends the pass everywhere.
  void fail(std::exception_ptr error) const {
    auto self = engine.lock();
    if (!self) {
      result->setError(error);
      return;
    }
    auto ended = result;
    self->abortPass(contextId, passId, workers, error, deadline)
        ->addCallback([ended](c10::ivalue::Future& aborted) {
          ended->setError(aborted.exception_ptr());
        });
  }

  // When every part of the pass is done (E4), or one failed.
  void finish(c10::ivalue::Future& all) const {
    if (all.hasError()) {
      fail(all.exception_ptr());
      return;
    }
    if (auto live = context.lock()) {
      live->removePass(passId);
    }
    result->markCompleted(c10::IValue());
  }
};

FuturePtr DistEngine::backward(
    int64_t contextId,
    const std::vector<at::Tensor>& roots,
    const std::vector<at::Tensor>& grads,
    const BackwardOptions& options) {
  auto context = contexts_.find(contextId);
  TORCH_CHECK(
      context,
      "no distributed autograd context ",
      contextId,
      " on worker '",
      runtime_.self().name,
      "' (released, or never joined)");
  auto [edges, rootGrads] = takeRoots(roots, grads);
  auto driven = std::make_shared<DrivenPass>();
  driven->engine = weak_from_this();
  driven->context = context;
  driven->contextId = contextId;
  driven->passId = (selfId_ << kIdShift) | nextPassId_.fetch_add(1);
  driven->deadline = deadlineOf(options);
  driven->startedAt = std::chrono::steady_clock::now();
  auto pass = findOrCreatePass(
      context,
      driven->passId,
      options.retainGraph,
      /*holdsDeliveries=*/false);
  LocalBackward::NewlyReached reached;
  try {
    reached = pass->addRoots(edges, std::move(rootGrads));
  } catch (...) {
    context->removePass(driven->passId);
    throw;
  }
  discoverThenRun(driven, pass, context, reached);
  rpc::Tracer& tracer = agent_.tracer();
  if (tracer.enabled()) {
    // Note [Tracing]: the whole pass, as its driver saw it.
    auto startedAt = driven->startedAt;
    std::string name = "backward (context " + std::to_string(contextId) +
        ", pass " + std::to_string(driven->passId) + ")";
    int64_t passId = driven->passId;
    driven->result->addCallback([&tracer, startedAt, name, contextId, passId](
                                    c10::ivalue::Future& done) {
      rpc::TraceArgs args = {{"context", contextId}, {"pass", passId}};
      if (done.hasError()) {
        args.emplace_back(
            "error",
            rpc::describeException(done.exception_ptr()));
      }
      tracer.complete(
          "autograd.pass",
          name,
          startedAt,
          std::chrono::steady_clock::now(),
          std::move(args));
    });
  }
  return driven->result;
}

void DistEngine::discoverThenRun(
    const std::shared_ptr<DrivenPass>& driven,
    const std::shared_ptr<LocalBackward>& pass,
    const std::shared_ptr<DistContext>& context,
    const LocalBackward::NewlyReached& reached) {
  // May run on the thread that read the pass's last answer (runPass). On
  // failure it starts the abort there: a local hang report and messages,
  // never a wait, so that the deadline ends a pass even while every pool
  // thread is busy.
  auto finish = [driven](c10::ivalue::Future& all) { driven->finish(all); };
  if (discoveryEndsHere(*context, reached, selfId_)) {
    // D2'.
    pass->setSkippedDiscovery();
    for (const auto& entry : reached) {
      driven->workers.push_back(entry.first);
    }
    try {
      runPass(
          driven->contextId,
          pass,
          driven->workers,
          &reached,
          driven->remaining())
          ->addCallback(finish);
    } catch (...) {
      driven->fail(std::current_exception());
    }
    return;
  }
  FuturePtr found;
  try {
    found = discover(
        driven->contextId,
        driven->passId,
        pass->retainGraph(),
        reached,
        driven->remaining());
  } catch (...) {
    driven->fail(std::current_exception());
    return;
  }
  found->addCallback([driven, pass, finish, selfName = runtime_.self().name](
                         c10::ivalue::Future& discovered) {
    auto self = driven->engine.lock();
    if (discovered.hasError() || !self) {
      driven->fail(
          discovered.hasError() ? discovered.exception_ptr()
                                : rpc::makeRpcError(
                                      rpc::ErrorCode::kShuttingDown,
                                      selfName,
                                      kWhat,
                                      0,
                                      "the runtime is gone"));
      return;
    }
    std::set<int64_t> reachedWorkers;
    for (const auto& id : discovered.value().toIntList()) {
      if (id != self->selfId_) {
        reachedWorkers.insert(id);
      }
    }
    driven->workers.assign(reachedWorkers.begin(), reachedWorkers.end());
    self->runPass(
            driven->contextId,
            pass,
            driven->workers,
            nullptr,
            driven->remaining())
        ->addCallback(finish);
  });
}

FuturePtr DistEngine::runPass(
    int64_t contextId,
    const std::shared_ptr<LocalBackward>& pass,
    const std::vector<int64_t>& workers,
    const LocalBackward::NewlyReached* marks,
    std::chrono::milliseconds timeout) {
  std::vector<FuturePtr> parts{pass->done()};
  for (int64_t worker : workers) {
    wire::Await message;
    *message.mutable_pass() = passRef(contextId, pass->passId());
    if (marks != nullptr) {
      message.set_carries_marks(true);
      message.set_retain_graph(pass->retainGraph());
      for (int64_t messageId : marks->at(worker)) {
        message.add_marked_sends(messageId);
      }
    }
    auto request = passRequest(kAwaitKind, message, timeout);
    // Its answer usually ends the pass; only the engine's own callbacks
    // follow it (firstErrorOrAll, then finish), so it completes where it is
    // read and reaches a caller waiting in backward() without waking a pool
    // thread in between (backward() in dist_engine.h).
    request.callbacksRunWhereRead = true;
    parts.push_back(agent_.send(rpc::WorkerRef(worker), std::move(request)));
  }
  pass->start();
  return firstErrorOrAll(parts);
}

FuturePtr DistEngine::discover(
    int64_t contextId,
    int64_t passId,
    bool retainGraph,
    const LocalBackward::NewlyReached& newlyReached,
    std::chrono::milliseconds timeout) {
  auto context = contextOrThrow(contextId);
  auto pass = context->findPass(passId);
  TORCH_CHECK(pass, describePass(contextId, passId), " ended");
  // Sends to this worker itself are marked here, without a message.
  LocalBackward::NewlyReached reached = newlyReached;
  for (auto self = reached.find(selfId_); self != reached.end();
       self = reached.find(selfId_)) {
    std::vector<std::shared_ptr<SendFunction>> sends;
    for (int64_t messageId : self->second) {
      auto send = context->findSend(messageId);
      TORCH_CHECK(send, "no send #", messageId, " here");
      sends.push_back(std::move(send));
    }
    reached.erase(self);
    for (auto& entry : pass->markSends(sends)) {
      auto& ids = reached[entry.first];
      ids.insert(ids.end(), entry.second.begin(), entry.second.end());
    }
  }
  std::vector<FuturePtr> answers;
  for (const auto& entry : reached) {
    wire::Discover message;
    *message.mutable_pass() = passRef(contextId, passId);
    message.set_retain_graph(retainGraph);
    message.set_timeout_ms(timeout.count());
    for (int64_t id : entry.second) {
      message.add_message_ids(id);
    }
    answers.push_back(agent_.send(
        rpc::WorkerRef(entry.first),
        passRequest(kDiscoverKind, message, timeout)));
  }
  auto found = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  int64_t selfId = selfId_;
  firstErrorOrAll(answers)->addCallback(
      [found, selfId](c10::ivalue::Future& all) {
        if (all.hasError()) {
          found->setError(all.exception_ptr());
          return;
        }
        std::set<int64_t> workers{selfId};
        for (const c10::IValue& answer : all.value().toListRef()) {
          for (int64_t id : answer.toFuture()->value().toIntList()) {
            workers.insert(id);
          }
        }
        found->markCompleted(c10::List<int64_t>(
            std::vector<int64_t>(workers.begin(), workers.end())));
      });
  return found;
}

namespace {

// The id of the trace flow from the gradients of recv #messageId to the
// send that receives them (tools/trace/README.md, flows): unique in the job,
// as context, pass and message ids are.
std::string gradientFlowId(
    int64_t contextId,
    int64_t passId,
    int64_t messageId) {
  return "grad/" + std::to_string(contextId) + "/" + std::to_string(passId) +
      "/" + std::to_string(messageId);
}

} // namespace

void DistEngine::sendGradients(
    int64_t contextId,
    const std::shared_ptr<LocalBackward>& pass,
    const std::shared_ptr<RecvFunction>& recv,
    torch::autograd::variable_list grads) {
  wire::Gradients message;
  *message.mutable_pass() = passRef(contextId, pass->passId());
  message.set_message_id(recv->messageId());
  if (pass->skippedDiscovery()) {
    message.set_marks_come_with_await(true);
    message.set_retain_graph(pass->retainGraph());
  }
  auto request =
      passRequest(kGradientsKind, message, runtime_.options().defaultTimeout);
  for (auto& grad : grads) {
    request.values.emplace_back(
        grad.defined() ? c10::IValue(std::move(grad)) : c10::IValue());
  }
  pass->addUnacknowledged();
  std::weak_ptr<LocalBackward> weakPass = pass;
  int64_t messageId = recv->messageId();
  std::string to = workerName(recv->fromWorker());
  std::string self = runtime_.self().name;
  // Note [Tracing]: the arrow from here to where the send receives them.
  rpc::TraceSpan span(agent_.tracer(), "autograd.gradients");
  if (span) {
    span.name("gradients of recv #" + std::to_string(messageId) + " -> " + to);
    span.arg("context", contextId);
    span.arg("pass", pass->passId());
    span.arg("flow_out", gradientFlowId(contextId, pass->passId(), messageId));
  }
  agent_.send(rpc::WorkerRef(recv->fromWorker()), std::move(request))
      ->addCallback([weakPass, messageId, to, self](c10::ivalue::Future& sent) {
        auto pass = weakPass.lock();
        if (!pass) {
          return;
        }
        if (sent.hasError()) {
          pass->fail(rpc::makeRpcError(
              rpc::ErrorCode::kWorkerUnavailable,
              to,
              kWhat,
              0,
              "the gradients of send #" + std::to_string(messageId) + " (" +
                  to + " -> " + self + ") could not be delivered to " + to +
                  ": " + rpc::describeException(sent.exception_ptr())));
        }
        pass->acknowledged();
      });
}

namespace {

// The sends a failed pass still waited for, gathered from every worker for
// the timeout error (G3). Thread-safe.
class WaitingSends {
 public:
  explicit WaitingSends(std::vector<std::string> names)
      : names_(std::move(names)) {}

  // A worker's hang report (Runtime::hangReport()) at the abort: what it
  // waited for then, for a timeout's error.
  void addReport(std::string report) {
    // Enough lines per worker to see what is stuck without burying it.
    constexpr size_t kMaxLines = 24;
    std::istringstream lines(report);
    std::string line;
    std::string kept;
    size_t count = 0;
    while (std::getline(lines, line)) {
      if (count++ < kMaxLines) {
        kept += line + "\n";
      }
    }
    if (count > kMaxLines) {
      kept += "  ... and " + std::to_string(count - kMaxLines) + " more\n";
    }
    std::lock_guard<std::mutex> guard(mutex_);
    reports_.push_back(std::move(kept));
  }

  // Send #messageId on worker `at` never got its gradient from `from`.
  void add(int64_t at, int64_t messageId, int64_t from) {
    std::string line = "send #" + std::to_string(messageId) + " (" + name(at) +
        " -> " + name(from) + ") on " + name(at) +
        " never got its gradient from " + name(from);
    std::lock_guard<std::mutex> guard(mutex_);
    lines_.push_back(std::move(line));
  }

  // What the pass fails with: `error`, or for a timeout one that names
  // every send still waiting.
  std::exception_ptr finalError(
      std::exception_ptr error,
      const std::string& pass,
      std::chrono::milliseconds deadline) {
    try {
      std::rethrow_exception(error);
    } catch (const rpc::RpcError& e) {
      if (e.code() != rpc::ErrorCode::kTimeout) {
        return error;
      }
      std::lock_guard<std::mutex> guard(mutex_);
      std::ostringstream text;
      text << "distributed backward (" << pass << ") did not finish within "
           << deadline.count() << " ms";
      if (lines_.empty()) {
        text << "; " << e.what();
      }
      for (const auto& line : lines_) {
        text << "; " << line;
      }
      if (!reports_.empty()) {
        text << "\nwhat each worker waited for when the pass was aborted:\n";
        for (const auto& report : reports_) {
          text << report;
        }
      }
      return rpc::makeRpcError(
          rpc::ErrorCode::kTimeout,
          e.worker(),
          kWhat,
          0,
          text.str());
    } catch (...) {
      return error;
    }
  }

 private:
  std::string name(int64_t id) const {
    return id >= 0 && id < static_cast<int64_t>(names_.size())
        ? names_[id]
        : "worker id " + std::to_string(id);
  }

  const std::vector<std::string> names_;
  std::mutex mutex_;
  std::vector<std::string> lines_;
  std::vector<std::string> reports_;
};

} // namespace

FuturePtr DistEngine::abortPass(
    int64_t contextId,
    int64_t passId,
    const std::vector<int64_t>& workers,
    std::exception_ptr error,
    std::chrono::milliseconds deadline) {
  std::vector<std::string> names;
  for (const auto& worker : agent_.workers()) {
    names.push_back(worker.name);
  }
  auto waiting = std::make_shared<WaitingSends>(std::move(names));
  std::string reason = rpc::describeException(error);
  // Before the pass is failed here: the report says what it waits for.
  waiting->addReport(runtime_.hangReport());
  if (auto context = contexts_.find(contextId)) {
    if (auto pass = context->findPass(passId)) {
      for (const auto& entry : pass->waitingSends()) {
        waiting->add(selfId_, entry.first, entry.second);
      }
      pass->fail(error);
      context->removePass(passId);
    }
  }
  std::vector<FuturePtr> answers;
  wire::Abort message;
  *message.mutable_pass() = passRef(contextId, passId);
  message.set_reason(reason);
  auto timeout = std::min(kAbortTimeout, runtime_.options().defaultTimeout);
  for (int64_t worker : workers) {
    auto answer = agent_.send(
        rpc::WorkerRef(worker),
        passRequest(kAbortKind, message, timeout));
    // Each answers with the sends it still waited for, and its hang
    // report.
    answer->addCallback([waiting, worker](c10::ivalue::Future& done) {
      if (done.hasError() || !done.value().isTuple()) {
        return;
      }
      const auto& parts = done.value().toTupleRef().elements();
      if (parts.size() != 2 || !parts[0].isIntList() || !parts[1].isString()) {
        return;
      }
      auto pairs = parts[0].toIntList();
      for (size_t i = 0; i + 1 < pairs.size(); i += 2) {
        waiting->add(worker, pairs.get(i), pairs.get(i + 1));
      }
      waiting->addReport(parts[1].toStringRef());
    });
    answers.push_back(answer);
  }
  auto result = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  auto release = contexts_.release;
  // Whatever the answers, the pass ends here.
  rpc::allSettled(answers)->addCallback(
      [result, waiting, error, release, contextId, passId, deadline](
          c10::ivalue::Future&) {
        auto final = waiting->finalError(
            error,
            describePass(contextId, passId),
            deadline);
        // E4: a failed pass releases its context everywhere.
        release(contextId)->addCallback(
            [result, final](c10::ivalue::Future&) { result->setError(final); });
      });
  return result;
}

FuturePtr DistEngine::backwardOnOwner(
    int64_t contextId,
    const c10::IValue& root,
    const BackwardOptions& options) {
  auto rref = rref::RRef<at::Tensor>::fromIValue(root);
  if (rref.isOwner()) {
    return backward(contextId, {rref.localValue()}, {}, options);
  }
  wire::BackwardOnOwner message;
  message.set_context_id(contextId);
  message.set_retain_graph(options.retainGraph);
  message.set_deadline_ms(deadlineOf(options).count());
  // The owner's pass has the deadline; its answer may take a little more.
  auto request = passRequest(
      kBackwardOnOwnerKind,
      message,
      deadlineOf(options) + kAbortTimeout + runtime_.options().defaultTimeout);
  request.values.push_back(root);
  return agent_.send(rpc::WorkerRef(rref.owner()), std::move(request));
}

// ---- handlers
// -----------------------------------------------------------------

FuturePtr DistEngine::onDiscover(rpc::Request&& request) {
  auto message = parseOrThrow<wire::Discover>(request, "autograd.discover");
  int64_t contextId = message.pass().context_id();
  int64_t passId = message.pass().pass_id();
  auto context = contextOrThrow(contextId);
  auto pass = findOrCreatePass(
      context,
      passId,
      message.retain_graph(),
      /*holdsDeliveries=*/false);
  LocalBackward::NewlyReached reached;
  reached[selfId_].assign(
      message.message_ids().begin(),
      message.message_ids().end());
  auto timeout =
      std::chrono::milliseconds(std::max<int64_t>(1, message.timeout_ms()));
  return discover(contextId, passId, message.retain_graph(), reached, timeout);
}

FuturePtr DistEngine::onGradients(rpc::Request&& request) {
  auto message = parseOrThrow<wire::Gradients>(request, "autograd.gradients");
  int64_t contextId = message.pass().context_id();
  int64_t passId = message.pass().pass_id();
  auto context = contextOrThrow(contextId);
  // D2': gradients may come before the kAwait that names what to wait for,
  // so they create the pass (held until that kAwait).
  auto pass = message.marks_come_with_await() ? findOrCreatePass(
                                                    context,
                                                    passId,
                                                    message.retain_graph(),
                                                    /*holdsDeliveries=*/true)
                                              : context->findPass(passId);
  if (!pass) {
    throw rpc::RpcError(
        rpc::ErrorCode::kBadArguments,
        runtime_.self().name,
        kWhat,
        request.id,
        describePass(contextId, passId) + " is not running here");
  }
  torch::autograd::variable_list grads;
  for (auto& value : request.values) {
    if (value.isNone()) {
      grads.emplace_back();
    } else if (value.isTensor()) {
      grads.push_back(std::move(value).toTensor());
    } else {
      throw rpc::RpcError(
          rpc::ErrorCode::kBadArguments,
          runtime_.self().name,
          kWhat,
          request.id,
          "gradients must be tensors or None, got " + value.tagKind());
    }
  }
  rpc::TraceSpan span(agent_.tracer(), "autograd.gradients");
  if (span) {
    span.name(
        "gradients for send #" + std::to_string(message.message_id()) + " <- " +
        request.from.name);
    span.arg("context", contextId);
    span.arg("pass", passId);
    span.arg(
        "flow_in",
        gradientFlowId(contextId, passId, message.message_id()));
  }
  bool readyToRun = false;
  try {
    readyToRun = pass->accept(message.message_id(), std::move(grads));
  } catch (...) {
    // Failing the pass completes its future, whose callbacks run where it
    // completes: on the pool, not on the transport's thread.
    auto error = std::current_exception();
    agent_.threadPool().run([pass, error]() { pass->fail(error); });
    throw;
  }
  if (readyToRun) {
    // The answer says the gradients were taken (E3), and their sender's
    // part of the pass waits for it. So it leaves now, and what they make
    // ready runs on the pool: run here, the answer would leave only after
    // this worker's whole part, after the kAwait's, one more message at the
    // end of every pass. A node's failure fails the pass (the kAwait's
    // answer), as when the pass runs on any other thread. It runs as if
    // in this handler: in its request's scope, traced if the request is
    // (Note [Tracing]).
    agent_.threadPool().run([pass,
                             scope = rpc::currentRequestScope(),
                             marked = rpc::Tracer::threadMarked()]() {
      rpc::RequestScopeGuard inScope(scope);
      rpc::Tracer::ThreadMark mark(marked);
      try {
        pass->drain();
      } catch (...) {
        pass->fail(std::current_exception());
      }
    });
  }
  return readyFuture();
}

FuturePtr DistEngine::onAwait(rpc::Request&& request) {
  auto message = parseOrThrow<wire::Await>(request, "autograd.await");
  int64_t contextId = message.pass().context_id();
  int64_t passId = message.pass().pass_id();
  auto context = contextOrThrow(contextId);
  // D2': the kAwait may come after gradients, which created the pass.
  auto pass = message.carries_marks() ? findOrCreatePass(
                                            context,
                                            passId,
                                            message.retain_graph(),
                                            /*holdsDeliveries=*/true)
                                      : context->findPass(passId);
  auto refuse = [&](const std::string& why) {
    auto error = rpc::makeRpcError(
        rpc::ErrorCode::kBadArguments,
        runtime_.self().name,
        kWhat,
        request.id,
        describePass(contextId, passId) + ": " + why);
    if (pass) {
      pass->fail(error);
      context->removePass(passId);
    }
    std::rethrow_exception(error);
  };
  if (!pass) {
    refuse("it is not running here");
  }
  if (message.carries_marks()) {
    // D2'.
    std::vector<std::shared_ptr<SendFunction>> sends;
    for (int64_t messageId : message.marked_sends()) {
      auto send = context->findSend(messageId);
      if (!send) {
        refuse("no send #" + std::to_string(messageId) + " here");
      }
      sends.push_back(std::move(send));
    }
    LocalBackward::NewlyReached further;
    try {
      further = pass->arm(sends);
    } catch (const std::exception& e) {
      refuse(rpc::describeException(e));
    }
    if (!further.empty()) {
      refuse(
          "sends were marked without discovery, but the graph behind them "
          "reaches tensors received from other workers");
    }
  }
  auto answer = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  std::weak_ptr<DistContext> weakContext = context;
  pass->done()->addCallback(
      [answer, weakContext, passId](c10::ivalue::Future& done) {
        if (auto context = weakContext.lock()) {
          context->removePass(passId);
        }
        if (done.hasError()) {
          answer->setError(done.exception_ptr());
        } else {
          answer->markCompleted(c10::IValue());
        }
      });
  return answer;
}

FuturePtr DistEngine::onAbort(rpc::Request&& request) {
  auto message = parseOrThrow<wire::Abort>(request, "autograd.abort");
  std::vector<int64_t> pairs;
  // What this worker waited for, before its part of the pass is failed.
  std::string report = runtime_.hangReport();
  auto context = contexts_.find(message.pass().context_id());
  auto pass = context ? context->findPass(message.pass().pass_id()) : nullptr;
  if (pass) {
    for (const auto& entry : pass->waitingSends()) {
      pairs.push_back(entry.first);
      pairs.push_back(entry.second);
    }
    pass->fail(rpc::makeRpcError(
        rpc::ErrorCode::kRemoteException,
        request.from.name,
        kWhat,
        0,
        "the pass was aborted: " + message.reason()));
    context->removePass(message.pass().pass_id());
  }
  return readyFuture(c10::ivalue::Tuple::create(
      {c10::IValue(c10::List<int64_t>(pairs)),
       c10::IValue(std::move(report))}));
}

FuturePtr DistEngine::onBackwardOnOwner(rpc::Request&& request) {
  auto message =
      parseOrThrow<wire::BackwardOnOwner>(request, "autograd.backwardOnOwner");
  if (request.values.size() != 1 || !request.values[0].isRRef()) {
    throw rpc::RpcError(
        rpc::ErrorCode::kBadArguments,
        runtime_.self().name,
        kWhat,
        request.id,
        "backward on an RRef's owner takes one RRef");
  }
  // The owner may not have joined the context yet (its loss may be local).
  contexts_.join(message.context_id());
  BackwardOptions options;
  options.retainGraph = message.retain_graph();
  options.deadline =
      std::chrono::milliseconds(std::max<int64_t>(1, message.deadline_ms()));
  auto rref = rref::RRef<at::Tensor>::fromIValue(request.values[0]);
  return backward(message.context_id(), {rref.localValue()}, {}, options);
}

} // namespace autograd
} // namespace torchrpc
