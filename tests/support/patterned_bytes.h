#pragma once

// Byte tensors whose every byte depends on its position and a seed, and
// their exact comparison: for transport tests where a swapped, shifted,
// truncated or overwritten tensor must show.

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace torchrpc {
namespace rpc {
namespace harness {

// Distinct bytes per tensor (seed) and per 4 KiB page, so a tensor that is
// another's, or shifted by a page, differs.
inline at::Tensor patterned(size_t nbytes, int seed) {
  auto tensor = at::empty({static_cast<int64_t>(nbytes)}, at::kByte);
  auto* data = tensor.data_ptr<uint8_t>();
  for (size_t i = 0; i < nbytes; ++i) {
    data[i] = static_cast<uint8_t>((i * 131 + seed * 7 + (i >> 12)) & 0xff);
  }
  return tensor;
}

inline bool sameBytes(const at::Tensor& got, const at::Tensor& want) {
  return got.nbytes() == want.nbytes() &&
      std::memcmp(got.data_ptr(), want.data_ptr(), want.nbytes()) == 0;
}

} // namespace harness
} // namespace rpc
} // namespace torchrpc
