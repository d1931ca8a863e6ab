#include "torchrpc/rpc/transport/tcp/shared_segments.h"

#include <ATen/ATen.h>
#include <c10/core/Storage.h>
#include <c10/util/Exception.h>

#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "torchrpc/rpc/transport/receive_buffer_pool.h"
#include "torchrpc/rpc/transport/tcp/memfd.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

namespace {

// The flags of a segment's header page: in use (the first u32) and
// retired (the second: its sender freed it, so a receiver's idle mapping
// only keeps the memory alive). Lock-free, so they work across processes
// mapping the same page.
std::atomic<uint32_t>* inUseFlag(void* base) {
  static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared flag");
  return reinterpret_cast<std::atomic<uint32_t>*>(base);
}

std::atomic<uint32_t>* retiredFlag(void* base) {
  return reinterpret_cast<std::atomic<uint32_t>*>(base) + 1;
}

} // namespace

// ---- Sender ----

struct SegmentSender::Segment {
  uint64_t id = 0;
  int fd = -1;
  void* base = nullptr;
  size_t bytes = 0; // the whole mapping, header page included
  SharedMemoryCharge charge; // `bytes`, in the transport's budget

  size_t capacity() const {
    return bytes - kSegmentDataOffset;
  }
  std::atomic<uint32_t>& inUse() const {
    return *inUseFlag(base);
  }
};

SegmentSender::SegmentSender(
    std::shared_ptr<std::atomic<size_t>> chargedBytes,
    size_t maxBytes,
    ParallelCopier* copier)
    : chargedBytes_(std::move(chargedBytes)),
      maxBytes_(maxBytes),
      copier_(copier) {}

SegmentSender::~SegmentSender() {
  for (auto& segment : segments_) {
    destroy(*segment);
  }
}

void SegmentSender::destroy(Segment& segment) {
  // The receiver's mapping, if any, keeps the memory until it unmaps; the
  // flag tells it to unmap first when idle.
  retiredFlag(segment.base)->store(1, std::memory_order_release);
  OwnMemfd memfd{segment.fd, segment.base, segment.bytes};
  destroyMemfd(memfd);
  segment.charge = SharedMemoryCharge();
}

SegmentSender::Segment* SegmentSender::acquireLocked(size_t capacity) {
  Segment* best = nullptr;
  for (auto& segment : segments_) {
    if (segment->capacity() >= capacity &&
        segment->inUse().load(std::memory_order_acquire) == 0 &&
        (best == nullptr || segment->bytes < best->bytes)) {
      best = segment.get();
    }
  }
  if (best != nullptr) {
    best->inUse().store(1, std::memory_order_relaxed);
    return best;
  }
  const size_t bytes = kSegmentDataOffset + capacity;
  // Make room by freeing idle segments too small to serve, smallest first
  // (a workload whose sizes change does not pin the budget in old sizes).
  std::sort(
      segments_.begin(),
      segments_.end(),
      [](const std::unique_ptr<Segment>& a, const std::unique_ptr<Segment>& b) {
        return a->bytes < b->bytes;
      });
  for (size_t i = 0; i < segments_.size() &&
       chargedBytes_->load(std::memory_order_relaxed) + bytes > maxBytes_;) {
    if (segments_[i]->inUse().load(std::memory_order_acquire) == 0) {
      destroy(*segments_[i]);
      segments_.erase(segments_.begin() + i);
    } else {
      ++i;
    }
  }
  SharedMemoryCharge charge =
      SharedMemoryCharge::tryCharge(chargedBytes_, bytes, maxBytes_);
  if (!charge.held()) {
    return nullptr;
  }
  const OwnMemfd memfd = createSealedMemfd("torchrpc-segment", bytes);
  if (memfd.fd < 0) {
    return nullptr; // the charge goes with it
  }
  auto segment = std::make_unique<Segment>();
  segment->charge = std::move(charge);
  segment->fd = memfd.fd;
  segment->base = memfd.base;
  segment->bytes = memfd.bytes;
  segment->id = nextId_++;
  segment->inUse().store(1, std::memory_order_relaxed);
  segments_.push_back(std::move(segment));
  return segments_.back().get();
}

size_t segmentBytesFor(size_t nbytes) {
  // Bucketed as the receive pool does, so that sizes differing by a few
  // bytes share a segment; whole pages.
  const size_t capacity =
      (ReceiveBufferPool::bucketCapacity(nbytes) + kSegmentDataOffset - 1) &
      ~(kSegmentDataOffset - 1);
  return kSegmentDataOffset + capacity;
}

std::optional<SegmentPlacement> SegmentSender::copyIn(
    const at::Tensor& tensor) {
  const size_t nbytes = tensor.nbytes();
  const size_t capacity = segmentBytesFor(nbytes) - kSegmentDataOffset;
  Segment* segment = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    segment = acquireLocked(capacity);
  }
  if (segment == nullptr) {
    return std::nullopt;
  }
  // The segment is ours until the receiver clears its flag: no lock needed
  // to fill it, and only this connection destroys it (after all sends).
  void* dst = static_cast<char*>(segment->base) + kSegmentDataOffset;
  if (copier_ != nullptr) {
    copier_->copy(dst, tensor.data_ptr(), nbytes);
  } else {
    std::memcpy(dst, tensor.data_ptr(), nbytes);
  }
  return SegmentPlacement{segment->id, segment->fd};
}

size_t SegmentSender::segmentCount() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return segments_.size();
}

size_t SegmentSender::segmentBytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  size_t total = 0;
  for (const auto& segment : segments_) {
    total += segment->bytes;
  }
  return total;
}

// ---- Receiver ----

struct SegmentReceiver::Mapping {
  void* base = nullptr;
  size_t bytes = 0;
  // Whether a tensor of ours views it now (private: the peer cannot
  // clear it).
  std::atomic<bool> held{false};

  ~Mapping() {
    ::munmap(base, bytes);
  }
};

namespace {

// The DataPtr context of a received tensor: its mapping, kept alive.
struct SegmentView {
  std::shared_ptr<void> mapping;
  std::atomic<bool>* held;
  std::atomic<uint32_t>* inUse;
};

void releaseSegmentView(void* context) {
  auto* view = static_cast<SegmentView*>(context);
  // Ours first: once the peer sees its flag clear it may send the segment
  // again, and the reader must then find it not held.
  view->held->store(false, std::memory_order_release);
  view->inUse->store(0, std::memory_order_release);
  delete view;
}

} // namespace

SegmentReceiver::SegmentReceiver(size_t maxTensorBytes)
    : maxSegmentBytes_(segmentBytesFor(maxTensorBytes)) {}

SegmentReceiver::~SegmentReceiver() = default;

void SegmentReceiver::evictIdle() {
  // Retired segments first: the sender will not send them again.
  size_t idle = 0;
  for (auto it = mapped_.begin(); it != mapped_.end();) {
    if (it->second->held.load(std::memory_order_acquire)) {
      ++it;
    } else if (
        retiredFlag(it->second->base)->load(std::memory_order_acquire) != 0) {
      it = mapped_.erase(it);
    } else {
      ++idle;
      ++it;
    }
  }
  // Then the oldest (lowest id) beyond the bound, leaving room for one more.
  for (auto it = mapped_.begin();
       it != mapped_.end() && idle >= kMaxIdleMappings;) {
    if (!it->second->held.load(std::memory_order_acquire)) {
      it = mapped_.erase(it);
      --idle;
    } else {
      ++it;
    }
  }
}

std::string SegmentReceiver::view(
    pid_t peerPid,
    const SegmentPlacement& placement,
    uint64_t length,
    at::Tensor& out) {
  auto it = mapped_.find(placement.segment);
  if (it == mapped_.end()) {
    if (placement.fd < 0) {
      return "bad shared segment descriptor";
    }
    const PeerMemfdLimits limits{
        "shared segment",
        kSegmentDataOffset,
        maxSegmentBytes_,
        "shared segment is larger than any tensor this connection accepts"};
    void* base = nullptr;
    size_t bytes = 0;
    const std::string refusal =
        mapPeerMemfd(peerPid, placement.fd, limits, base, bytes);
    if (!refusal.empty()) {
      return refusal;
    }
    auto mapping = std::make_shared<Mapping>();
    mapping->base = base;
    mapping->bytes = bytes;
    // Before the insertion: it must not evict the mapping we return.
    evictIdle();
    it = mapped_.emplace(placement.segment, std::move(mapping)).first;
  }
  const std::shared_ptr<Mapping>& mapping = it->second;
  if (length > mapping->bytes - kSegmentDataOffset) {
    return "tensor exceeds its shared segment";
  }
  if (mapping->held.exchange(true, std::memory_order_acq_rel)) {
    return "shared segment reused while a received tensor still views it";
  }
  char* data = static_cast<char*>(mapping->base) + kSegmentDataOffset;
  auto* context =
      new SegmentView{mapping, &mapping->held, inUseFlag(mapping->base)};
  c10::DataPtr dataPtr(
      data,
      context,
      &releaseSegmentView,
      c10::Device(c10::DeviceType::CPU));
  c10::Storage storage(
      c10::Storage::use_byte_size_t(),
      static_cast<size_t>(length),
      std::move(dataPtr),
      /*allocator=*/nullptr,
      /*resizable=*/false);
  out = at::empty({0}, at::TensorOptions().dtype(at::kByte))
            .set_(storage, 0, {static_cast<int64_t>(length)}, {1});
  return std::string();
}

bool viewsSharedSegment(const at::Tensor& tensor) {
  return tensor.defined() && tensor.has_storage() &&
      tensor.storage().data_ptr().get_deleter() == &releaseSegmentView;
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
