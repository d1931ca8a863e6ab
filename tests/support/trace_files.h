#pragma once

// The trace file a worker wrote at shutdown (Note [Tracing] in
// rpc/tracing.h), read as raw JSON for tests that check its events.

#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>
#include <string>

namespace torchrpc {
namespace testing {

// DIRECTORY/worker<rank>.trace.json, parsed; throws if it is not JSON.
inline nlohmann::json readWorkerTraceJson(
    const std::string& directory,
    int rank) {
  std::ifstream file(
      directory + "/worker" + std::to_string(rank) + ".trace.json");
  std::stringstream text;
  text << file.rdbuf();
  return nlohmann::json::parse(text.str());
}

} // namespace testing
} // namespace torchrpc
