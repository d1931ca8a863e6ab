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

// Whether messages of `kind` belong to no context's forward: they record
// no send/recv functions and carry no context metadata, whatever context
// the sending thread is in. A running pass's own traffic is such (gradients
// crossing workers are not a forward), and so are two kinds that name
// their context in their body:
//
// - kReleaseContextKind: its context is already released where it is sent,
//   sometimes from a thread still inside it (a pass that failed on this
//   worker alone is released on the thread that ran it). Recording it there
//   would join the released context, which is refused, and the release would
//   never reach the peers.
// - kGraphDumpKind: looking at a context's graph must not make the workers
//   asked join it.
//
// kBackwardOnOwnerKind is not one, on purpose: it is a request the program
// makes in its context, as a call is. Like a call it carries the context
// id (R1), so the owner, which joins the context to drive the pass there,
// becomes a peer of the sender and is told to release the context (R4)
// even when no forward message ever reached it.
constexpr bool belongsToNoForward(uint32_t kind) {
  switch (kind) {
    case kReleaseContextKind:
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
