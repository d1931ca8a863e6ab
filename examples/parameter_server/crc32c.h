#pragma once

// CRC-32C (Castagnoli), as TensorFlow's record format checksums records.

#include <cstddef>
#include <cstdint>

namespace ps {

uint32_t crc32c(const void* data, size_t size);

// The masked form records store, so that a CRC over bytes that themselves
// contain CRCs stays well distributed (TensorFlow's crc32c::Mask).
inline uint32_t maskedCrc32c(const void* data, size_t size) {
  uint32_t crc = crc32c(data, size);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

} // namespace ps
