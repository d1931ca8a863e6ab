#include "torchrpc/autograd/graph_dump.h"

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <deque>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "torchrpc/autograd/context_container.h"
#include "torchrpc/autograd/dist_context.h"
#include "torchrpc/autograd/messages.h"
#include "torchrpc/autograd/send_recv_functions.h"
#include "torchrpc/rpc/agent.h"
#include "torchrpc/rpc/errors.h"

namespace torchrpc {
namespace autograd {

namespace {

using torch::autograd::Node;

std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
    }
    out += c == '\n' ? ' ' : c;
  }
  return out + "\"";
}

std::string workerName(
    const std::vector<rpc::WorkerInfo>& workers,
    int64_t id) {
  return id >= 0 && id < static_cast<int64_t>(workers.size())
      ? workers[id].name
      : "worker " + std::to_string(id);
}

// Node names that other workers' fragments can refer to.
std::string sendNodeId(int64_t worker, int64_t messageId) {
  return "w" + std::to_string(worker) + "_send_" + std::to_string(messageId);
}
std::string recvNodeId(int64_t worker, int64_t messageId) {
  return "w" + std::to_string(worker) + "_recv_" + std::to_string(messageId);
}

std::string shapeOf(const at::Tensor& tensor) {
  std::ostringstream out;
  out << tensor.sizes();
  return out.str();
}

} // namespace

namespace detail {

GraphFragment drawLocalGraph(
    const DistContext& context,
    const rpc::WorkerInfo& self,
    const std::vector<rpc::WorkerInfo>& workers,
    const std::vector<at::Tensor>& roots) {
  GraphFragment out;
  std::ostringstream cluster;
  std::ostringstream cross;
  std::unordered_map<const Node*, std::string> ids;
  std::deque<const Node*> queue;
  bool truncated = false;
  size_t next = 0;

  // Names `node`, queues it the first time; empty past the cap.
  auto idOf = [&](const Node* node) -> std::string {
    auto it = ids.find(node);
    if (it != ids.end()) {
      return it->second;
    }
    if (ids.size() >= kMaxGraphNodes) {
      truncated = true;
      return "";
    }
    std::string id;
    std::string label;
    std::string style;
    if (const auto* send = dynamic_cast<const SendFunction*>(node)) {
      id = sendNodeId(self.id, send->messageId());
      label = "send #" + std::to_string(send->messageId()) + " to " +
          workerName(workers, send->toWorker());
      style = ",shape=box,style=filled,fillcolor=lightblue";
    } else if (const auto* recv = dynamic_cast<const RecvFunction*>(node)) {
      id = recvNodeId(self.id, recv->messageId());
      label = "recv #" + std::to_string(recv->messageId()) + " from " +
          workerName(workers, recv->fromWorker());
      style = ",shape=box,style=filled,fillcolor=lightyellow";
    } else {
      id = "w" + std::to_string(self.id) + "_n" + std::to_string(next++);
      label = node->name();
      if (const auto* leaf =
              dynamic_cast<const torch::autograd::AccumulateGrad*>(node)) {
        label += " " + shapeOf(leaf->variable);
        style = ",shape=ellipse,style=filled,fillcolor=lightgrey";
      }
    }
    ids.emplace(node, id);
    cluster << "    " << id << " [label=" << quoted(label) << style << "];\n";
    queue.push_back(node);
    return id;
  };

  for (const auto& entry : context.sends()) {
    idOf(entry.second.get());
  }
  for (const auto& entry : context.recvs()) {
    idOf(entry.second.get());
  }
  for (const auto& root : roots) {
    if (root.defined() && root.grad_fn()) {
      idOf(root.grad_fn().get());
    }
  }
  while (!queue.empty()) {
    const Node* node = queue.front();
    queue.pop_front();
    const std::string from = ids.at(node);
    if (const auto* recv = dynamic_cast<const RecvFunction*>(node)) {
      // Its gradients go back to the sender's send of the same message.
      cross << "  " << from << " -> "
            << sendNodeId(recv->fromWorker(), recv->messageId())
            << " [style=dashed,color=blue,label="
            << quoted("grad #" + std::to_string(recv->messageId())) << "];\n";
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      if (!edge.is_valid()) {
        continue;
      }
      std::string to = idOf(edge.function.get());
      if (!to.empty()) {
        cluster << "    " << from << " -> " << to << ";\n";
      }
    }
  }
  out.nodes = ids.size();
  std::ostringstream text;
  text << "  subgraph cluster_w" << self.id << " {\n"
       << "    label="
       << quoted(self.name + " (context " + std::to_string(context.id()) + ")")
       << ";\n"
       << cluster.str();
  if (truncated) {
    text << "    // stopped at " << kMaxGraphNodes << " nodes\n";
  }
  text << "  }\n";
  out.cluster = text.str();
  out.crossEdges = cross.str();
  return out;
}

void registerGraphDump(rpc::Agent& agent, ContextContainer& container) {
  std::weak_ptr<ContextContainer> weak = container.shared_from_this();
  rpc::Agent* agentPtr = &agent;
  agent.registerHandler(
      kGraphDumpKind,
      "autograd.graph_dump",
      [weak, agentPtr](rpc::Request&& request) {
        auto future =
            c10::make_intrusive<c10::ivalue::Future>(c10::TupleType::create(
                {c10::StringType::get(), c10::StringType::get()}));
        int64_t contextId = 0;
        try {
          contextId = std::stoll(request.body);
        } catch (const std::exception&) {
          throw rpc::RpcError(
              rpc::ErrorCode::kBadArguments,
              agentPtr->self().name,
              "autograd.graph_dump",
              request.id,
              "the body is not a context id");
        }
        auto self = weak.lock();
        auto context = self ? self->find(contextId) : nullptr;
        if (!context) {
          future->markCompleted(c10::ivalue::Tuple::create(
              {c10::IValue(std::string()), c10::IValue(std::string())}));
          return future;
        }
        GraphFragment fragment =
            drawLocalGraph(*context, agentPtr->self(), agentPtr->workers(), {});
        future->markCompleted(c10::ivalue::Tuple::create(
            {c10::IValue(std::move(fragment.cluster)),
             c10::IValue(std::move(fragment.crossEdges))}));
        return future;
      },
      rpc::RequestLabel::kHandlerName,
      rpc::Cancellation::kDropIfQueued,
      // A stuck job must still answer (Note [Graph dump]); the drawing is
      // bounded by kMaxGraphNodes.
      rpc::Dispatch::kInline);
}

} // namespace detail

std::string graphDot(
    rpc::Runtime& runtime,
    int64_t contextId,
    const std::vector<at::Tensor>& roots,
    std::chrono::milliseconds timeout) {
  TORCH_CHECK(timeout.count() > 0, "graphDot() needs a positive timeout");
  auto container = ContextContainer::of(runtime);
  rpc::Agent& agent = runtime.agent();
  std::vector<std::pair<std::string, c10::intrusive_ptr<c10::ivalue::Future>>>
      asked;
  for (const auto& worker : runtime.workers()) {
    if (worker.id == runtime.self().id || agent.lostCause(worker.id)) {
      continue;
    }
    rpc::OutgoingRequest request;
    request.kind = kGraphDumpKind;
    request.body = std::to_string(contextId);
    request.what = "autograd.graph_dump";
    request.timeout = timeout;
    // Completed on the transport's thread: this worker's own pool may be
    // the one that is stuck.
    request.awaitedSynchronously = true;
    asked.emplace_back(worker.name, agent.send(worker.id, std::move(request)));
  }
  std::ostringstream dot;
  std::ostringstream cross;
  std::ostringstream notes;
  bool anyone = false;
  dot << "digraph " << quoted("context " + std::to_string(contextId)) << " {\n"
      << "  // torchrpc distributed autograd graph (Note [Graph dump])\n"
      << "  rankdir=LR;\n  node [fontsize=10];\n";
  if (auto context = container->find(contextId)) {
    auto fragment = detail::drawLocalGraph(
        *context,
        runtime.self(),
        runtime.workers(),
        roots);
    dot << fragment.cluster;
    cross << fragment.crossEdges;
    anyone = true;
  } else {
    notes << "  // " << runtime.self().name << " does not hold it\n";
  }
  for (auto& entry : asked) {
    entry.second->wait();
    if (entry.second->hasError()) {
      notes << "  // " << entry.first << " did not answer: "
            << rpc::describeException(entry.second->exception_ptr()) << "\n";
      continue;
    }
    auto parts = entry.second->value().toTuple();
    const std::string& cluster = parts->elements().at(0).toStringRef();
    if (cluster.empty()) {
      notes << "  // " << entry.first << " does not hold it\n";
      continue;
    }
    anyone = true;
    dot << cluster;
    cross << parts->elements().at(1).toStringRef();
  }
  TORCH_CHECK(
      anyone,
      "no worker holds distributed autograd context ",
      contextId,
      " (released, or never opened)");
  dot << cross.str() << notes.str() << "}\n";
  return dot.str();
}

} // namespace autograd
} // namespace torchrpc
