#pragma once

// Private: envelopes reused from message to message on one thread, so that
// encoding and parsing a small message does not allocate its parts anew.

#include <memory>

namespace torchrpc {
namespace rpc {

namespace wire {
class Envelope;
} // namespace wire

namespace detail {

// Note [Recycled envelopes]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A call's envelope is small (a value, a tensor descriptor, a body), yet
// each of its parts is a heap object, allocated when it is built or parsed
// and freed with it. A cleared protobuf message keeps what it allocated (the
// elements of its repeated fields, the capacity of its strings and of a
// descriptor's sizes) and reuses it for the next message. So each thread
// keeps a few cleared envelopes and hands them out again, and a caller or
// an io thread that encodes and parses one message after another does so
// without allocating the envelope's parts. Measured with callgrind on a
// one-element call, this saved about 5 k of the 37 k instructions torchrpc
// itself spends on a round trip, handler aside (bench/RESULTS.md).
//
// Guarantees:
//  1. An envelope handed out is empty (Clear()ed): what the last message put
//     in it never reaches the next one.
//  2. Memory stays bounded: a thread keeps at most kKeptPerThread
//     envelopes, and an envelope is kept only if its message was small (few
//     values, descriptors, dimensions and metadata entries, a short body);
//     any other is deleted, so one large message cannot pin its memory in
//     a thread. What is kept is cleared: nested values are freed, strings
//     and repeated fields keep only their capacity.
//  3. An envelope may be released on any thread; it joins that thread's
//     cache. Nothing is shared between threads, so nothing is locked.
struct EnvelopeRecycler {
  void operator()(wire::Envelope* envelope) const noexcept;
};

using RecycledEnvelope = std::unique_ptr<wire::Envelope, EnvelopeRecycler>;

// An empty envelope: one this thread kept, or a new one.
RecycledEnvelope takeEnvelope();

// How many envelopes this thread keeps now. For tests.
int keptEnvelopesOnThisThread();

} // namespace detail
} // namespace rpc
} // namespace torchrpc
