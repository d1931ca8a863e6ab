#pragma once

// How the envelope and value fuzzers read their input as a transport
// message, and how the corpus generator writes one: u8 tensor count (taken
// modulo kMaxFuzzTensors + 1), then per tensor a u16 length (little-endian)
// and its bytes, then the header to the end. Tensors arrive as a transport
// delivers them: fresh 1-D byte tensors.

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace fuzz {

constexpr size_t kMaxFuzzTensors = 4;

inline Message messageFromBytes(const uint8_t* data, size_t size) {
  Message message;
  size_t at = 0;
  const size_t count = size > 0 ? data[at++] % (kMaxFuzzTensors + 1) : 0;
  for (size_t i = 0; i < count; ++i) {
    if (size - at < 2) {
      break;
    }
    size_t length = data[at] | (size_t(data[at + 1]) << 8);
    at += 2;
    if (length > size - at) {
      length = size - at;
    }
    auto tensor = at::empty({static_cast<int64_t>(length)}, at::kByte);
    if (length > 0) {
      std::memcpy(tensor.data_ptr(), data + at, length);
    }
    at += length;
    message.tensors.push_back(std::move(tensor));
  }
  message.header.assign(reinterpret_cast<const char*>(data) + at, size - at);
  return message;
}

// The inverse, for the corpus generator; tensors are contiguous CPU tensors
// of at most 64 KiB each.
inline std::string bytesFromMessage(
    const std::string& header,
    const std::vector<at::Tensor>& tensors) {
  std::string out(1, static_cast<char>(tensors.size()));
  for (const auto& tensor : tensors) {
    const size_t length = tensor.nbytes();
    out += static_cast<char>(length & 0xff);
    out += static_cast<char>((length >> 8) & 0xff);
    out.append(static_cast<const char*>(tensor.data_ptr()), length);
  }
  return out + header;
}

} // namespace fuzz
} // namespace rpc
} // namespace torchrpc
