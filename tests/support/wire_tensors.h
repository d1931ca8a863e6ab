#pragma once

// For tests of the codec without a transport (tests/rpc/wire/).

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace torchrpc {
namespace rpc {
namespace harness {

// What a transport delivers: every tensor's bytes in a fresh 1-D byte tensor.
inline std::vector<at::Tensor> asWireTensors(
    const std::vector<at::Tensor>& sent) {
  std::vector<at::Tensor> wire;
  wire.reserve(sent.size());
  for (const auto& tensor : sent) {
    EXPECT_TRUE(tensor.is_contiguous());
    EXPECT_TRUE(tensor.device().is_cpu());
    auto bytes = at::empty({static_cast<int64_t>(tensor.nbytes())}, at::kByte);
    if (tensor.nbytes() > 0) {
      std::memcpy(bytes.data_ptr(), tensor.data_ptr(), tensor.nbytes());
    }
    wire.push_back(std::move(bytes));
  }
  return wire;
}

// Every dtype the codec sends.
inline const std::vector<at::ScalarType>& wireDtypes() {
  static const std::vector<at::ScalarType> dtypes = {
      at::kBool,
      at::kByte,
      at::kChar,
      at::kShort,
      at::kInt,
      at::kLong,
      at::kHalf,
      at::kBFloat16,
      at::kFloat,
      at::kDouble,
      at::kComplexFloat,
      at::kComplexDouble};
  return dtypes;
}

} // namespace harness
} // namespace rpc
} // namespace torchrpc
