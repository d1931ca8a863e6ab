// libFuzzer target: what the TCP transport reads before it allocates (Note
// [TCP transport wire format]): the 16-byte frame header, the caps of a data
// frame, the tensor lengths, and the fixed-size control bodies. Checks that
// whatever is accepted is within the caps the receiver then allocates by.
//
// Input: u8 selecting the limits, the frame header, then what follows it on
// the wire (tensor lengths, or a control body).

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "torchrpc/rpc/detail/store_server.h"
#include "torchrpc/rpc/transport/tcp/frame.h"
#include "torchrpc/rpc/transport/tcp/same_host.h"

using namespace torchrpc::rpc;
using namespace torchrpc::rpc::detail::tcp;

namespace {

// The limits a worker runs with, small ones, and the rendezvous store's
// (no tensors at all).
TransportLimits limitsFor(uint8_t selector) {
  TransportLimits limits;
  switch (selector % 3) {
    case 0:
      break;
    case 1:
      limits.maxHeaderBytes = 4096;
      limits.maxMessageBytes = 1 << 20;
      limits.maxTensorsPerMessage = 16;
      break;
    default: {
      torchrpc::rpc::detail::StoreLimits store;
      limits.maxHeaderBytes = store.maxRequestBytes();
      limits.maxMessageBytes = store.maxRequestBytes();
      limits.maxTensorsPerMessage = 0;
      break;
    }
  }
  return limits;
}

void require(bool condition) {
  if (!condition) {
    std::abort();
  }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 + kFrameHeaderBytes) {
    return 0;
  }
  const TransportLimits limits = limitsFor(data[0]);
  const uint8_t* in = data + 1;
  const FrameHeader header = decodeFrameHeader(in);
  // The header round-trips through its encoder whenever its fields can be
  // written by it (reserved 0, the version this side speaks).
  if (header.magic == kMagic && header.version == kVersion &&
      header.reserved == 0) {
    std::string encoded =
        encodeFrameHeader(header.type, header.bodyBytes, header.count);
    require(encoded == std::string(reinterpret_cast<const char*>(in), 16));
  }
  if (!checkFrameHeader(header).empty()) {
    return 0;
  }
  const uint8_t* rest = in + kFrameHeaderBytes;
  const size_t restSize = size - 1 - kFrameHeaderBytes;

  if (header.type == FrameType::kCmaProbe ||
      header.type == FrameType::kCmaResult || header.type == FrameType::kAck) {
    const std::string body(reinterpret_cast<const char*>(rest), restSize);
    bool flag = false;
    bool segments = false;
    uint64_t word = 0;
    if (header.type == FrameType::kCmaProbe &&
        decodeCmaProbe(body, flag, segments, word)) {
      require(body.size() >= cmaBodyBytes(header.type));
      require(encodeCmaProbe(flag, segments, word) == body.substr(0, 9));
    } else if (
        header.type == FrameType::kCmaResult &&
        decodeCmaResult(body, flag, segments)) {
      require(encodeCmaResult(flag, segments) == body.substr(0, 1));
    } else if (header.type == FrameType::kAck && decodeAck(body, word)) {
      require(encodeAck(word) == body.substr(0, 8));
    }
    return 0;
  }
  if (header.type != FrameType::kData && header.type != FrameType::kDataCma &&
      header.type != FrameType::kDataShared) {
    return 0;
  }
  if (!checkDataFrameCaps(header, limits).empty()) {
    return 0;
  }
  // Accepted: the receiver now allocates the body and count lengths.
  require(header.count <= limits.maxTensorsPerMessage);
  require(header.bodyBytes <= limits.maxHeaderBytes);
  require(header.bodyBytes <= limits.maxMessageBytes);
  // The lengths as read off the wire (raw words), as many as the input has.
  std::vector<uint64_t> lengths(std::min<size_t>(header.count, restSize / 8));
  if (!lengths.empty()) {
    std::memcpy(lengths.data(), rest, lengths.size() * 8);
  }
  const std::vector<uint64_t> raw = lengths;
  if (!decodeTensorLengths(lengths, header.bodyBytes, limits).empty()) {
    return 0;
  }
  // Accepted: the receiver allocates each tensor; together with the body
  // they stay within maxMessageBytes, and each decoded length is the
  // little-endian reading of its wire bytes.
  uint64_t total = header.bodyBytes;
  for (size_t i = 0; i < lengths.size(); ++i) {
    require(
        lengths[i] ==
        getLe(reinterpret_cast<const unsigned char*>(&raw[i]), 8));
    require(lengths[i] <= limits.maxMessageBytes - total);
    total += lengths[i];
  }
  require(total <= limits.maxMessageBytes);
  // What a sender writes for the same frame reads back the same.
  std::vector<size_t> sizes(lengths.begin(), lengths.end());
  std::string prefix = encodeDataPrefix(header.bodyBytes, sizes, 0, {});
  require(prefix.size() == kFrameHeaderBytes + 8 * sizes.size());
  const FrameHeader again =
      decodeFrameHeader(reinterpret_cast<const unsigned char*>(prefix.data()));
  require(again.bodyBytes == header.bodyBytes);
  require(again.count == sizes.size());
  return 0;
}
