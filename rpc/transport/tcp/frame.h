#pragma once

// Framing of the TCP transport: the frame header, the byte helpers, the
// checks a receiver makes before it allocates, and the outgoing frame.
// Pure functions over bytes: no sockets, no threads, no OpenSSL.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

// Note [TCP transport wire format]
//
// Background: TensorPipe's uv transport costs four thread wake-ups per round
// trip (caller -> its loop, network -> callee loop, callee pool -> its loop,
// network -> caller loop) and its listener trusts a length prefix. This
// transport writes from the sending thread and reads on one io thread, so a
// round trip costs the two network wake-ups only, and it validates every
// byte it reads.
//
// Every frame, in both directions, starts with a 16-byte header, integers
// little-endian:
//
//   u32 magic 'TRPC' | u8 version (1) | u8 type | u16 reserved (0)
//   u32 body length  | u32 tensor count
//
// followed by `tensor count` u64 tensor lengths, then the body, then the
// tensors' bytes back to back. Types: kHello, kWelcome, kProof (handshake,
// no tensors, body at most 4 KiB; Note [TCP transport handshake]), kData
// (body = Message::header), kHeartbeat and kClose (empty), and the
// same-host frames kCmaProbe, kCmaResult, kAck and kDataCma (Note [TCP
// same-host zero copy]), kDataShared (Note [TCP same-host shared
// memory]), kRingOffer and kRingBell (Note [Shared rings for small
// frames] in tcp/shared_ring.h). A receiver checks the header, then reads the
// lengths (at most maxTensorsPerMessage of them), checks the body and the
// sum against TransportLimits, and only then allocates: the body as a
// string, each tensor as a ReceiveBufferPool buffer, read in place.
//
// Guarantees:
//   1. Any framing or cap violation on an open connection fails that
//      connection alone with kMalformedMessage and closes it.
//   2. EOF, reset, a kClose frame or peerTimeout of silence fail the
//      connection with kWorkerUnavailable; every pending send's done gets
//      the error.

constexpr uint32_t kMagic = 0x43505254; // "TRPC" as little-endian bytes
constexpr uint8_t kVersion = 1;
constexpr size_t kFrameHeaderBytes = 16;

enum class FrameType : uint8_t {
  kHello = 1,
  kWelcome = 2,
  kProof = 3,
  kData = 4,
  kHeartbeat = 5,
  kClose = 6,
  kCmaProbe = 7,
  kCmaResult = 8,
  kDataCma = 9,
  kAck = 10,
  kDataShared = 11,
  kRingOffer = 12,
  kRingBell = 13,
};

// Little-endian integers.
void putU16(char* out, uint16_t value);
void putU32(char* out, uint32_t value);
void putU64(char* out, uint64_t value);
uint64_t getLe(const unsigned char* in, int bytes);
// Appends a u64, little-endian.
void appendU64(std::string& out, uint64_t value);
// Reinterprets each word, as read off the wire, as little-endian.
void decodeLeWords(std::vector<uint64_t>& words);

// A frame header as read, before any check.
struct FrameHeader {
  uint32_t magic = 0;
  uint8_t version = 0;
  FrameType type = FrameType::kData;
  uint16_t reserved = 0;
  uint32_t bodyBytes = 0;
  uint32_t count = 0; // tensors
};

std::string encodeFrameHeader(
    FrameType type,
    uint32_t bodyBytes,
    uint32_t count);
// Reads kFrameHeaderBytes at `in`; never fails (see checkFrameHeader).
FrameHeader decodeFrameHeader(const unsigned char* in);

// The checks below return an empty string when the frame is acceptable,
// else why it is refused (the text of the error the connection fails with).

// Magic, version and reserved bits.
std::string checkFrameHeader(const FrameHeader& header);
// Tensor count, body and message caps of a kData or kDataCma frame, before
// its tensor lengths are read.
std::string checkDataFrameCaps(
    const FrameHeader& header,
    const TransportLimits& limits);
// Decodes the u64 lengths read off the wire in place and checks them (each
// and their sum with bodyBytes, which cannot wrap) against maxMessageBytes.
std::string decodeTensorLengths(
    std::vector<uint64_t>& lengths,
    size_t bodyBytes,
    const TransportLimits& limits);

// The header and tensor lengths of a data frame: kData when `addresses` is
// empty; else kDataCma followed by `id` and one address per tensor (0: its
// bytes follow inline) when `segments` is empty; else kDataShared followed
// by `id` and {segments[i], addresses[i]} per tensor (a segment's word is
// the sender's fd of it).
std::string encodeDataPrefix(
    uint32_t bodyBytes,
    const std::vector<size_t>& lengths,
    uint64_t id,
    const std::vector<uint64_t>& addresses,
    const std::vector<uint64_t>& segments = {});

// Reads a frame body; every accessor fails (returns false) instead of
// reading past the end. Holds a reference: `body` must outlive it.
class BodyReader {
 public:
  explicit BodyReader(const std::string& body) : body_(body) {}

  bool u8(uint8_t& out);
  bool bytes(size_t count, std::string& out);
  // u16 length, then that many bytes.
  bool shortString(std::string& out);
  bool u64(uint64_t& out);
  bool atEnd() const {
    return offset_ == body_.size();
  }

 private:
  const std::string& body_;
  size_t offset_ = 0;
};

// u16 length, then the bytes; values over 1024 bytes are truncated.
void appendShortString(std::string& out, const std::string& value);

// One outgoing frame and what keeps its bytes alive until it is written.
struct OutFrame {
  std::string prefix; // frame header + tensor lengths
  std::string body;
  std::vector<at::Tensor> tensors;
  Connection::SendCallback done; // empty for control frames
  size_t total = 0;
  size_t written = 0;
};

// A frame without tensors (handshake and control frames).
OutFrame controlFrame(FrameType type, std::string body = std::string());

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
