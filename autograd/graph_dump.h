#pragma once

// A distributed autograd context's graph as Graphviz DOT (Note [Graph
// dump]): what each worker recorded, and how gradients would cross workers.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace autograd {

class ContextContainer;
class DistContext;

// Note [Graph dump]
// ~~~~~~~~~~~~~~~~~
// Each worker draws its own part of a context's graph: a cluster with the
// libtorch autograd nodes its send functions reach (and, on the worker that
// asks, those its `roots` reach), ending at recv functions and leaves. Send
// and recv functions are named by message id ("send #12 to ps0"); an edge
// goes, as autograd's do, from a node to the nodes its gradients flow to. A
// recv function's gradients flow to the send of the same message on the
// worker it came from: that edge (dashed) crosses clusters. The asking worker
// gathers every worker's part (kGraphDumpKind, answered on the transport's
// thread so a stuck job still answers) and joins them into one digraph. A
// worker draws at most kMaxGraphNodes nodes and says when it stopped there.
constexpr size_t kMaxGraphNodes = 5000;

// The DOT text of context `contextId`'s graph on every worker of the job
// that holds it (one cluster each; workers that do not hold it, or do not
// answer within `timeout`, are named in a comment). `roots` (e.g. the loss)
// add this worker's part between them and its recv functions, which no
// send reaches. Throws c10::Error if no worker holds the context.
std::string graphDot(
    rpc::Runtime& runtime,
    int64_t contextId,
    const std::vector<at::Tensor>& roots = {},
    std::chrono::milliseconds timeout = std::chrono::seconds(10));

namespace detail {

// One worker's part: its cluster, and the edges that leave it.
struct GraphFragment {
  std::string cluster;
  std::string crossEdges;
  size_t nodes = 0;
};

GraphFragment drawLocalGraph(
    const DistContext& context,
    const rpc::WorkerInfo& self,
    const std::vector<rpc::WorkerInfo>& workers,
    const std::vector<at::Tensor>& roots);

// Registers the kGraphDumpKind handler (ContextContainer, before start()).
void registerGraphDump(rpc::Agent& agent, ContextContainer& container);

} // namespace detail
} // namespace autograd
} // namespace torchrpc
