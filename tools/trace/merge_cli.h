#pragma once

#include <ostream>

namespace torchrpc {
namespace trace {

// Exit statuses of torchrpc-trace-merge.
constexpr int kExitOk = 0;
constexpr int kExitBadInput = 1; // usage, unreadable or malformed input, I/O
constexpr int kExitCheckFailed = 2; // --check found a problem (file written)

// torchrpc-trace-merge [--check] [-o merged.json] FILE_OR_DIR...
// The summary goes to `out`, errors and --check failures to `err`.
int runTraceMerge(
    int argc,
    const char* const* argv,
    std::ostream& out,
    std::ostream& err);

} // namespace trace
} // namespace torchrpc
