#pragma once

// Same-host zero copy of the TCP transport: who the peer is on this host,
// the host section of the handshake, the probe that proves a peer can read
// our memory, the kCmaProbe/kCmaResult/kAck bodies, and the read itself.
// No sockets and no threads: the connection keeps a SameHostState on its
// strand and calls these.

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "torchrpc/rpc/transport/tcp/frame.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

// Note [TCP same-host zero copy]
//
// With sameHostZeroCopy on both sides, kHello and kWelcome (Note [TCP
// transport handshake]) may end with a section {u8 1 | short string
// boot_id | u64 pid namespace inode | u64 pid | 16-byte challenge},
// kWelcome's followed by u64 address. Each side that sees the same boot_id
// and pid namespace writes the peer's challenge into its own memory and
// announces where: the server in kWelcome, the client in a kCmaProbe {u8
// flags | u64 address} right after the handshake, answered by kCmaResult
// {u8 flags}; flag bit 0 is "I can read you", bit 1 "send me shared
// segments" (Note [TCP same-host shared memory] in tcp/shared_segments.h).
// A side "can read" its peer when one
// process_vm_readv of the announced address returns its own random
// challenge, which proves the announced pid is the peer (or cooperates with
// it). A sender uses kDataCma only once the peer said it can read it:
//
//   kDataCma = kData's header and lengths | u64 id | u64 address per
//              tensor (0: its bytes follow inline) | body | inline bytes
//
// (Note [TCP transport wire format] for kData.) The receiver validates the
// lengths as for kData, allocates pool buffers, reads every addressed
// tensor with process_vm_readv, then sends kAck {u64 id} and delivers. The
// sender keeps those tensors alive until the ack arrives or the connection
// fails (a send's done runs when the frame is written). A failed read fails
// the connection: kWorkerUnavailable if the peer process is gone (ESRCH),
// kMalformedMessage if it announced memory it does not have. A peer can
// only make us read its own address space, into buffers sized by validated
// lengths.

constexpr size_t kChallengeBytes = 16;

// What tells two processes they share a kernel and a pid namespace, so the
// pid a peer announces names the peer. Empty bootId: unknown, no zero copy.
struct HostIdentity {
  std::string bootId;
  uint64_t pidNamespace = 0;
  // Where this process's abstract Unix sockets are reachable (0: unknown);
  // Note [Local sockets for peers on this host] in tcp/endpoints.h.
  uint64_t networkNamespace = 0;
};

// This process's, from /proc; empty when /proc does not say.
HostIdentity localHostIdentity();

// The optional last section of kHello and kWelcome.
struct HostSection {
  std::string bootId;
  uint64_t pidNamespace = 0;
  uint64_t pid = 0;
  std::string challenge; // kChallengeBytes
  // kWelcome only: where the server keeps the client's challenge (0: it
  // does not, the client is not on its host).
  uint64_t address = 0;
};

// `withAddress`: kWelcome's section (followed by the address).
void appendHostSection(
    std::string& out,
    const HostSection& section,
    bool withAddress);
// False if the section is malformed. Call it only when bytes are left (the
// section is optional).
bool readHostSection(
    BodyReader& reader,
    bool withAddress,
    HostSection& section);

// Whether `section` names a process on this host and pid namespace.
bool onSameHost(const HostIdentity& ours, const HostSection& section);

// Reads `length` bytes at `from` in process `pid` into `to`. Returns 0 or
// the errno (EFAULT for a read that makes no progress).
int readFromPeer(pid_t pid, char* to, uint64_t from, size_t length);

// The body a kCmaProbe, kCmaResult, kAck or kRingOffer frame must have, 0
// for others.
size_t cmaBodyBytes(FrameType type);

// `sendSegments` (meaningful only with `canReadYou`): the peer may send us
// tensors in shared segments (Note [TCP same-host shared memory]).
std::string encodeCmaProbe(
    bool canReadYou,
    bool sendSegments,
    uint64_t address);
// False if malformed.
bool decodeCmaProbe(
    const std::string& body,
    bool& canReadYou,
    bool& sendSegments,
    uint64_t& address);
std::string encodeCmaResult(bool canReadYou, bool sendSegments);
bool decodeCmaResult(
    const std::string& body,
    bool& canReadYou,
    bool& sendSegments);
std::string encodeAck(uint64_t id);
bool decodeAck(const std::string& body, uint64_t& id);

// One connection's side of the zero-copy negotiation (its strand only).
struct SameHostState {
  // The challenge we sent (empty: none, zero copy is off here).
  std::string ourChallenge;
  // The peer's challenge, kept where the peer may read it.
  unsigned char probe[kChallengeBytes] = {};
  bool peerSentHost = false;
  bool peerOnHost = false;
  pid_t peerPid = 0;
  bool offeredCma = false; // server: sent a host section in kWelcome
  bool sentCmaProbe = false; // client
  bool gotCmaFrame = false; // kCmaProbe or kCmaResult seen
  bool weReadPeer = false; // kDataCma frames are accepted
  bool weMapPeer = false; // kDataShared frames are accepted

  // Our section for `host`, with a new random ourChallenge and where we
  // keep the peer's challenge (sent in kWelcome only); none when `host` is
  // unknown (zero copy is off).
  std::optional<HostSection> ourSection(const HostIdentity& host);
  // Records the peer's section.
  void notePeerSection(const HostIdentity& ours, const HostSection& section);
  // Where the peer finds its challenge in our memory (0: it is not on our
  // host).
  uint64_t probeAddress() const;
  // Whether the peer's memory at `address` holds the challenge we sent:
  // then peerPid is the peer (or lets the peer write its memory).
  bool probePeer(uint64_t address) const;
};

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
