#pragma once

// What a worker's layers report in Runtime::metrics(), by figure name.

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>

#include "torchrpc/rpc/metrics.h"
#include "torchrpc/rpc/runtime.h"

namespace torchrpc {
namespace testing {

// The figures `runtime` reports for `layer`; empty if it reports none.
inline std::map<std::string, double> layerValues(
    rpc::Runtime& runtime,
    const std::string& layer) {
  std::map<std::string, double> values;
  for (const auto& reported : runtime.metrics().layers) {
    if (reported.layer == layer) {
      for (const auto& value : reported.values) {
        values[value.name] = value.value;
      }
    }
  }
  return values;
}

// One figure of `layer` on `runtime`; NaN, and a failure, if it is not
// reported (so that no expected value matches a missing figure).
inline double layerValue(
    rpc::Runtime& runtime,
    const std::string& layer,
    const std::string& name) {
  auto values = layerValues(runtime, layer);
  auto it = values.find(name);
  if (it == values.end()) {
    ADD_FAILURE() << runtime.self().name << " reports no " << layer << " "
                  << name;
    return std::nan("");
  }
  return it->second;
}

} // namespace testing
} // namespace torchrpc
