#include "torchrpc/rpc/transport/tcp/frame.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace torchrpc {
namespace rpc {
namespace detail {
namespace tcp {

void putU16(char* out, uint16_t value) {
  for (int i = 0; i < 2; ++i) {
    out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  }
}

void putU32(char* out, uint32_t value) {
  for (int i = 0; i < 4; ++i) {
    out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  }
}

void putU64(char* out, uint64_t value) {
  for (int i = 0; i < 8; ++i) {
    out[i] = static_cast<char>((value >> (8 * i)) & 0xff);
  }
}

uint64_t getLe(const unsigned char* in, int bytes) {
  uint64_t value = 0;
  for (int i = bytes - 1; i >= 0; --i) {
    value = (value << 8) | in[i];
  }
  return value;
}

void appendU64(std::string& out, uint64_t value) {
  char word[8];
  putU64(word, value);
  out.append(word, 8);
}

void decodeLeWords(std::vector<uint64_t>& words) {
  for (uint64_t& word : words) {
    word = getLe(reinterpret_cast<const unsigned char*>(&word), 8);
  }
}

namespace {

// Writes kFrameHeaderBytes at `out`.
void writeFrameHeader(
    char* out,
    FrameType type,
    uint32_t bodyBytes,
    uint32_t count) {
  putU32(out, kMagic);
  out[4] = static_cast<char>(kVersion);
  out[5] = static_cast<char>(type);
  putU16(out + 6, 0);
  putU32(out + 8, bodyBytes);
  putU32(out + 12, count);
}

} // namespace

std::string encodeFrameHeader(
    FrameType type,
    uint32_t bodyBytes,
    uint32_t count) {
  std::string out(kFrameHeaderBytes, '\0');
  writeFrameHeader(out.data(), type, bodyBytes, count);
  return out;
}

FrameHeader decodeFrameHeader(const unsigned char* in) {
  FrameHeader header;
  header.magic = static_cast<uint32_t>(getLe(in, 4));
  header.version = in[4];
  header.type = static_cast<FrameType>(in[5]);
  header.reserved = static_cast<uint16_t>(getLe(in + 6, 2));
  header.bodyBytes = static_cast<uint32_t>(getLe(in + 8, 4));
  header.count = static_cast<uint32_t>(getLe(in + 12, 4));
  return header;
}

std::string checkFrameHeader(const FrameHeader& header) {
  if (header.magic != kMagic) {
    return "not a torchrpc TCP frame (bad magic)";
  }
  if (header.version != kVersion) {
    return "unsupported protocol version " + std::to_string(header.version);
  }
  if (header.reserved != 0) {
    return "reserved frame bits set";
  }
  return std::string();
}

std::string checkDataFrameCaps(
    const FrameHeader& header,
    const TransportLimits& limits) {
  if (header.count > limits.maxTensorsPerMessage) {
    return std::to_string(header.count) + " tensors exceed the cap of " +
        std::to_string(limits.maxTensorsPerMessage);
  }
  if (header.bodyBytes > limits.maxHeaderBytes) {
    return "header of " + std::to_string(header.bodyBytes) +
        " bytes exceeds the cap of " + std::to_string(limits.maxHeaderBytes);
  }
  if (header.bodyBytes > limits.maxMessageBytes) {
    return "message exceeds the cap of " +
        std::to_string(limits.maxMessageBytes) + " bytes";
  }
  return std::string();
}

std::string decodeTensorLengths(
    std::vector<uint64_t>& lengths,
    size_t bodyBytes,
    const TransportLimits& limits) {
  size_t total = bodyBytes;
  for (uint64_t& length : lengths) {
    length = getLe(reinterpret_cast<const unsigned char*>(&length), 8);
    // Compared one by one first so that the sum cannot wrap.
    if (length > limits.maxMessageBytes ||
        total + length > limits.maxMessageBytes) {
      return "message exceeds the cap of " +
          std::to_string(limits.maxMessageBytes) + " bytes";
    }
    total += length;
  }
  return std::string();
}

std::string encodeDataPrefix(
    uint32_t bodyBytes,
    const std::vector<size_t>& lengths,
    uint64_t id,
    const std::vector<uint64_t>& addresses,
    const std::vector<uint64_t>& segments) {
  const bool byAddress = !addresses.empty();
  const bool shared = byAddress && !segments.empty();
  const size_t count = lengths.size();
  // Sized once and written in place: one allocation per message sent.
  std::string prefix(
      kFrameHeaderBytes + 8 * count +
          (byAddress ? 8 * (1 + count * (shared ? 2 : 1)) : 0),
      '\0');
  writeFrameHeader(
      prefix.data(),
      shared          ? FrameType::kDataShared
          : byAddress ? FrameType::kDataCma
                      : FrameType::kData,
      bodyBytes,
      static_cast<uint32_t>(count));
  char* out = prefix.data() + kFrameHeaderBytes;
  auto put = [&out](uint64_t word) {
    putU64(out, word);
    out += 8;
  };
  for (size_t length : lengths) {
    put(length);
  }
  if (byAddress) {
    put(id);
    for (size_t i = 0; i < count; ++i) {
      if (shared) {
        put(segments[i]);
      }
      put(addresses[i]);
    }
  }
  TORCH_INTERNAL_ASSERT(out == prefix.data() + prefix.size());
  return prefix;
}

bool BodyReader::u8(uint8_t& out) {
  if (offset_ + 1 > body_.size()) {
    return false;
  }
  out = static_cast<uint8_t>(body_[offset_++]);
  return true;
}

bool BodyReader::bytes(size_t count, std::string& out) {
  if (count > body_.size() - offset_) {
    return false;
  }
  out = body_.substr(offset_, count);
  offset_ += count;
  return true;
}

bool BodyReader::shortString(std::string& out) {
  std::string length;
  if (!bytes(2, length)) {
    return false;
  }
  return bytes(
      getLe(reinterpret_cast<const unsigned char*>(length.data()), 2),
      out);
}

bool BodyReader::u64(uint64_t& out) {
  std::string bytes8;
  if (!bytes(8, bytes8)) {
    return false;
  }
  out = getLe(reinterpret_cast<const unsigned char*>(bytes8.data()), 8);
  return true;
}

void appendShortString(std::string& out, const std::string& value) {
  size_t length = std::min<size_t>(value.size(), 1024);
  char prefix[2];
  putU16(prefix, static_cast<uint16_t>(length));
  out.append(prefix, 2);
  out.append(value, 0, length);
}

OutFrame controlFrame(FrameType type, std::string body) {
  OutFrame frame;
  frame.prefix =
      encodeFrameHeader(type, static_cast<uint32_t>(body.size()), /*count=*/0);
  frame.body = std::move(body);
  frame.total = frame.prefix.size() + frame.body.size();
  return frame;
}

} // namespace tcp
} // namespace detail
} // namespace rpc
} // namespace torchrpc
