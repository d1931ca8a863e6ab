#include "torchrpc/rpc/transport/tcp/memfd.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

namespace {

constexpr unsigned kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

std::string errnoText(const std::string& what, int error) {
  return what + ": " + std::strerror(error);
}

} // namespace

SharedMemoryCharge SharedMemoryCharge::tryCharge(
    std::shared_ptr<std::atomic<size_t>> charged,
    size_t bytes,
    size_t maxBytes) {
  SharedMemoryCharge charge;
  if (bytes == 0 ||
      charged->fetch_add(bytes, std::memory_order_relaxed) + bytes > maxBytes) {
    if (bytes > 0) {
      charged->fetch_sub(bytes, std::memory_order_relaxed);
    }
    return charge;
  }
  charge.charged_ = std::move(charged);
  charge.bytes_ = bytes;
  return charge;
}

SharedMemoryCharge::SharedMemoryCharge(SharedMemoryCharge&& other) noexcept
    : charged_(std::move(other.charged_)),
      bytes_(std::exchange(other.bytes_, 0)) {}

SharedMemoryCharge& SharedMemoryCharge::operator=(
    SharedMemoryCharge&& other) noexcept {
  if (this != &other) {
    SharedMemoryCharge released(std::move(*this));
    charged_ = std::move(other.charged_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

SharedMemoryCharge::~SharedMemoryCharge() {
  if (bytes_ > 0) {
    charged_->fetch_sub(bytes_, std::memory_order_relaxed);
  }
}

OwnMemfd createSealedMemfd(const char* name, size_t bytes) {
  OwnMemfd memfd;
  int fd = ::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    return memfd;
  }
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0 ||
      ::fcntl(fd, F_ADD_SEALS, kSeals) != 0) {
    const int error = errno;
    ::close(fd);
    errno = error;
    return memfd;
  }
  void* base =
      ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int error = errno;
    ::close(fd);
    errno = error;
    return memfd;
  }
  memfd.fd = fd;
  memfd.base = base;
  memfd.bytes = bytes;
  return memfd;
}

void destroyMemfd(OwnMemfd& memfd) {
  if (memfd.fd < 0) {
    return;
  }
  ::munmap(memfd.base, memfd.bytes);
  ::close(memfd.fd);
  memfd = OwnMemfd();
}

std::string mapCheckedMemfd(
    int fd,
    const PeerMemfdLimits& limits,
    void*& base,
    size_t& bytes) {
  const std::string what(limits.what);
  struct statfs fs {};
  struct stat st {};
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (::fstatfs(fd, &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
    return what + " is not a memfd on tmpfs";
  }
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return what + " is not sealed against shrinking";
  }
  if (::fstat(fd, &st) != 0 || st.st_size < 0 ||
      static_cast<uint64_t>(st.st_size) < limits.minBytes) {
    return what + " is too small";
  }
  if (static_cast<uint64_t>(st.st_size) > limits.maxBytes) {
    // Address space, not memory, but a peer gets no more of it than the
    // caller's use needs.
    return limits.tooLarge;
  }
  const size_t size = static_cast<size_t>(st.st_size);
  void* mapped =
      ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (mapped == MAP_FAILED) {
    return errnoText("cannot map the peer's " + what, errno);
  }
  base = mapped;
  bytes = size;
  return std::string();
}

std::string mapPeerMemfd(
    pid_t peerPid,
    int fd,
    const PeerMemfdLimits& limits,
    void*& base,
    size_t& bytes) {
  const std::string path =
      "/proc/" + std::to_string(peerPid) + "/fd/" + std::to_string(fd);
  const int ours = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (ours < 0) {
    return errnoText(
        "cannot open the peer's " + std::string(limits.what),
        errno);
  }
  std::string refusal = mapCheckedMemfd(ours, limits, base, bytes);
  ::close(ours);
  return refusal;
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
