#pragma once

#include <cstdint>

namespace torchrpc {
namespace autograd {

// The message kinds of the autograd layer, registered with the agent at
// start-up (rpc/ owns [1, 15], rref/ [16, 31]; autograd/ takes [32, 47]).
// Their bodies are the messages of proto/autograd/autograd.proto.

// R4 of Note [Distributed autograd recording]
// (autograd/context_container.h): a context is released.
constexpr uint32_t kReleaseContextKind = 32;

// The steps of a backward pass (Note [Distributed backward] in
// autograd/engine/dist_engine.h).
constexpr uint32_t kDiscoverKind = 33;
constexpr uint32_t kGradientsKind = 34;
constexpr uint32_t kAwaitKind = 35;
constexpr uint32_t kAbortKind = 36;

// Starts a pass on the owner of an RRef root, which drives it.
constexpr uint32_t kBackwardOnOwnerKind = 37;

// graphDot(): "draw your part of this context" (Note [Graph dump] in
// autograd/graph_dump.h).
constexpr uint32_t kGraphDumpKind = 38;

// Whether `kind` is a running pass's own traffic, which belongs to no
// context's forward: it records no send/recv functions (gradients crossing
// workers are not a forward), and carries no context metadata.
//
// kBackwardOnOwnerKind is not one, on purpose: it is a request the program
// makes in its context, as a call is. Like a call it carries the context
// id (R1), so the owner, which joins the context to drive the pass there,
// becomes a peer of the sender and is told to release the context (R4)
// even when no forward message ever reached it.
constexpr bool isBackwardPassKind(uint32_t kind) {
  switch (kind) {
    // Not a pass's, but no forward's either: looking at a context's graph
    // must not make the workers asked join it.
    case kGraphDumpKind:
    case kDiscoverKind:
    case kGradientsKind:
    case kAwaitKind:
    case kAbortKind:
      return true;
    default:
      return false;
  }
}

} // namespace autograd
} // namespace torchrpc
