#pragma once

// Which transport a suite runs over is an rpc::TransportKind, in every tier;
// this names it in parameterized test names.

#include <gtest/gtest.h>

#include <ostream>
#include <string>

#include "torchrpc/rpc/options.h"

namespace torchrpc {
namespace testing {

// "InProcess", "TensorPipe", "Tcp": the transport's part of a test name.
inline std::string transportName(rpc::TransportKind kind) {
  switch (kind) {
    case rpc::TransportKind::kAuto:
      return "Auto";
    case rpc::TransportKind::kInProcess:
      return "InProcess";
    case rpc::TransportKind::kTensorPipe:
      return "TensorPipe";
    case rpc::TransportKind::kTcp:
      return "Tcp";
  }
  return "Unknown";
}

// The name generator of INSTANTIATE_TEST_SUITE_P over rpc::TransportKind.
inline std::string transportParamName(
    const ::testing::TestParamInfo<rpc::TransportKind>& info) {
  return transportName(info.param);
}

} // namespace testing

namespace rpc {

// How GoogleTest prints the parameter (found by argument-dependent lookup):
// "GetParam() = Tcp" in failures and CTest entries, not the enum's bytes.
inline void PrintTo(TransportKind kind, std::ostream* out) {
  *out << testing::transportName(kind);
}

} // namespace rpc
} // namespace torchrpc
