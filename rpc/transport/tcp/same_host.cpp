#include "torchrpc/rpc/transport/tcp/same_host.h"

#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <utility>

#include "torchrpc/rpc/transport/tcp/handshake.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

namespace {

// process_vm_readv moves at most this much per call (it caps a call at
// MAX_RW_COUNT anyway); looping keeps a short read from being an error.
constexpr size_t kMaxPeerReadBytes = size_t(1) << 30;

} // namespace

HostIdentity localHostIdentity() {
  HostIdentity identity;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string bootId;
  struct stat info {};
  if (std::getline(in, bootId) && !bootId.empty() &&
      ::stat("/proc/self/ns/pid", &info) == 0) {
    identity.bootId = bootId;
    identity.pidNamespace = info.st_ino;
    if (::stat("/proc/self/ns/net", &info) == 0) {
      identity.networkNamespace = info.st_ino;
    }
  }
  return identity;
}

void appendHostSection(
    std::string& out,
    const HostSection& section,
    bool withAddress) {
  out += '\1';
  appendShortString(out, section.bootId);
  appendU64(out, section.pidNamespace);
  appendU64(out, section.pid);
  out += section.challenge;
  if (withAddress) {
    appendU64(out, section.address);
  }
}

bool readHostSection(
    BodyReader& reader,
    bool withAddress,
    HostSection& section) {
  uint8_t flag = 0;
  if (!reader.u8(flag) || flag != 1 || !reader.shortString(section.bootId) ||
      !reader.u64(section.pidNamespace) || !reader.u64(section.pid) ||
      !reader.bytes(kChallengeBytes, section.challenge)) {
    return false;
  }
  return !withAddress || reader.u64(section.address);
}

bool onSameHost(const HostIdentity& ours, const HostSection& section) {
  return !ours.bootId.empty() && section.bootId == ours.bootId &&
      section.pidNamespace == ours.pidNamespace && section.pid > 0 &&
      section.pid <= static_cast<uint64_t>(std::numeric_limits<pid_t>::max());
}

int readFromPeer(pid_t pid, char* to, uint64_t from, size_t length) {
  size_t done = 0;
  while (done < length) {
    size_t chunk = std::min(length - done, kMaxPeerReadBytes);
    iovec local{to + done, chunk};
    iovec remote{reinterpret_cast<void*>(from + done), chunk};
    ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      return errno;
    }
    if (n == 0) {
      return EFAULT;
    }
    done += static_cast<size_t>(n);
  }
  return 0;
}

size_t cmaBodyBytes(FrameType type) {
  switch (type) {
    case FrameType::kCmaProbe:
      return 9;
    case FrameType::kAck:
      return 8;
    case FrameType::kRingOffer:
      return 16;
    case FrameType::kCmaResult:
      return 1;
    default:
      return 0;
  }
}

namespace {

// The flag byte of kCmaProbe and kCmaResult: bit 0 "I can read you", bit 1
// "send me shared segments" (only with bit 0; Note [TCP same-host shared
// memory] in tcp/shared_segments.h).
constexpr uint8_t kCanReadYou = 1;
constexpr uint8_t kSendSegments = 2;

uint8_t encodeCmaFlag(bool canReadYou, bool sendSegments) {
  if (!canReadYou) {
    return 0;
  }
  return kCanReadYou | (sendSegments ? kSendSegments : 0);
}

bool decodeCmaFlag(uint8_t flag, bool& canReadYou, bool& sendSegments) {
  if ((flag & ~(kCanReadYou | kSendSegments)) != 0 || flag == kSendSegments) {
    return false;
  }
  canReadYou = (flag & kCanReadYou) != 0;
  sendSegments = (flag & kSendSegments) != 0;
  return true;
}

} // namespace

std::string encodeCmaProbe(
    bool canReadYou,
    bool sendSegments,
    uint64_t address) {
  std::string body(
      1,
      static_cast<char>(encodeCmaFlag(canReadYou, sendSegments)));
  appendU64(body, address);
  return body;
}

bool decodeCmaProbe(
    const std::string& body,
    bool& canReadYou,
    bool& sendSegments,
    uint64_t& address) {
  BodyReader reader(body);
  uint8_t flag = 0;
  return reader.u8(flag) && decodeCmaFlag(flag, canReadYou, sendSegments) &&
      reader.u64(address);
}

std::string encodeCmaResult(bool canReadYou, bool sendSegments) {
  return std::string(
      1,
      static_cast<char>(encodeCmaFlag(canReadYou, sendSegments)));
}

bool decodeCmaResult(
    const std::string& body,
    bool& canReadYou,
    bool& sendSegments) {
  BodyReader reader(body);
  uint8_t flag = 0;
  return reader.u8(flag) && decodeCmaFlag(flag, canReadYou, sendSegments);
}

std::string encodeAck(uint64_t id) {
  std::string body;
  appendU64(body, id);
  return body;
}

bool decodeAck(const std::string& body, uint64_t& id) {
  BodyReader reader(body);
  return reader.u64(id);
}

std::optional<HostSection> SameHostState::ourSection(const HostIdentity& host) {
  if (host.bootId.empty()) {
    return std::nullopt;
  }
  ourChallenge = randomBytes(kChallengeBytes);
  HostSection section;
  section.bootId = host.bootId;
  section.pidNamespace = host.pidNamespace;
  section.pid = static_cast<uint64_t>(::getpid());
  section.challenge = ourChallenge;
  section.address = probeAddress();
  return section;
}

void SameHostState::notePeerSection(
    const HostIdentity& ours,
    const HostSection& section) {
  peerSentHost = true;
  peerOnHost = onSameHost(ours, section);
  if (peerOnHost) {
    peerPid = static_cast<pid_t>(section.pid);
    std::memcpy(probe, section.challenge.data(), kChallengeBytes);
  }
}

uint64_t SameHostState::probeAddress() const {
  return peerOnHost ? reinterpret_cast<uintptr_t>(probe) : 0;
}

bool SameHostState::probePeer(uint64_t address) const {
  if (!peerOnHost || address == 0 || ourChallenge.empty()) {
    return false;
  }
  std::string got(kChallengeBytes, '\0');
  return readFromPeer(peerPid, &got[0], address, got.size()) == 0 &&
      equalInConstantTime(got, ourChallenge);
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
