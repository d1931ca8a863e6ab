#include "torchrpc/rpc/wire/recycled_envelope.h"

#include "proto/rpc/envelope.pb.h"

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

// Enough for a thread that holds a request's envelope while it encodes the
// reply and parses the next message; beyond that, new ones are cheap.
constexpr int kKeptPerThread = 4;

// What a kept envelope may have held (Note [Recycled envelopes], 2): a
// cleared envelope keeps its repeated fields' elements and its body's
// capacity, and each kept descriptor its sizes' capacity.
constexpr int kMaxKeptValues = 16;
constexpr int kMaxKeptTensors = 16;
constexpr int kMaxKeptDims = 16;
constexpr int kMaxKeptMetadata = 8;
constexpr size_t kMaxKeptBodyBytes = 4096;

bool smallEnoughToKeep(const wire::Envelope& envelope) {
  if (envelope.values_size() > kMaxKeptValues ||
      envelope.tensors_size() > kMaxKeptTensors ||
      envelope.metadata_size() > kMaxKeptMetadata ||
      envelope.body().capacity() > kMaxKeptBodyBytes) {
    return false;
  }
  for (const auto& tensor : envelope.tensors()) {
    if (tensor.sizes_size() > kMaxKeptDims) {
      return false;
    }
  }
  return true;
}

// This thread's cleared envelopes. Trivially destructible, so it stays
// usable while the thread's other thread_local objects are destroyed (one of
// them may release an envelope); KeptEnvelopesDeleter empties and closes it.
struct KeptEnvelopes {
  wire::Envelope* kept[kKeptPerThread];
  int count;
  bool closed;
};
thread_local KeptEnvelopes tlsKept = {{}, 0, false};

struct KeptEnvelopesDeleter {
  ~KeptEnvelopesDeleter() {
    tlsKept.closed = true;
    while (tlsKept.count > 0) {
      delete tlsKept.kept[--tlsKept.count];
    }
  }
};

// False when the thread keeps enough already, or is ending.
bool roomToKeep() {
  return !tlsKept.closed && tlsKept.count < kKeptPerThread;
}

void keep(wire::Envelope* envelope) {
  // Constructed on the thread's first keep, so it is destroyed at the
  // thread's end, after anything constructed before it.
  thread_local KeptEnvelopesDeleter deleter;
  (void)deleter;
  tlsKept.kept[tlsKept.count++] = envelope;
}

} // namespace

void EnvelopeRecycler::operator()(wire::Envelope* envelope) const noexcept {
  if (envelope == nullptr) {
    return;
  }
  // Room first: a thread that only releases (a pool thread running
  // handlers of envelopes an io thread parsed) keeps a full cache, and
  // clearing what is then deleted would be wasted.
  if (roomToKeep() && smallEnoughToKeep(*envelope)) {
    envelope->Clear();
    keep(envelope);
    return;
  }
  delete envelope;
}

RecycledEnvelope takeEnvelope() {
  if (tlsKept.count > 0) {
    return RecycledEnvelope(tlsKept.kept[--tlsKept.count]);
  }
  return RecycledEnvelope(new wire::Envelope());
}

int keptEnvelopesOnThisThread() {
  return tlsKept.count;
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
