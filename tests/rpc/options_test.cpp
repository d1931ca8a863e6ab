// Options::fromEnvironment() for the variables that let a job be observed
// (README "Observing a job") and those of same-host transfers: each sets its
// field exactly, and a malformed value is a c10::Error naming the variable
// and the value. The launcher's
// identity variables are launch_environment_test.cpp's.

#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>

#include "tests/support/scoped_env.h"
#include "torchrpc/rpc/options.h"

namespace torchrpc {
namespace {

using testing::errorOfFromEnvironment;

void expectRefusedNaming(const char* variable, const char* value) {
  ::setenv(variable, value, 1);
  std::string message = errorOfFromEnvironment();
  EXPECT_NE(message.find(variable), std::string::npos)
      << "'" << value << "': " << message;
  EXPECT_NE(message.find("'" + std::string(value) + "'"), std::string::npos)
      << "'" << value << "': " << message;
}

class OptionsFromEnvironment : public ::testing::Test {
 protected:
  testing::ScopedLauncherEnv launcher_;
  testing::ScopedEnv observability_{
      "TORCHRPC_TRACE_DIR",
      "TORCHRPC_TRACE_STEPS",
      "TORCHRPC_TRACE_MAX_EVENTS",
      "TORCHRPC_METRICS_ADDR"};
};

TEST_F(OptionsFromEnvironment, TraceDirectoryIsTheVariableAsGiven) {
  EXPECT_EQ(rpc::Options::fromEnvironment().traceDirectory, "");
  ::setenv("TORCHRPC_TRACE_DIR", "/tmp/a job's traces", 1);
  EXPECT_EQ(
      rpc::Options::fromEnvironment().traceDirectory,
      "/tmp/a job's traces");
  // Empty is unset, as for every variable: no tracing.
  ::setenv("TORCHRPC_TRACE_DIR", "", 1);
  EXPECT_EQ(rpc::Options::fromEnvironment().traceDirectory, "");
}

TEST_F(OptionsFromEnvironment, TraceStepsAreFirstColonCountOrCount) {
  rpc::Options options = rpc::Options::fromEnvironment();
  EXPECT_EQ(options.traceFirstStep, 0);
  EXPECT_EQ(options.traceStepCount, 0);
  for (auto [text, first, count] :
       {std::tuple<const char*, int64_t, int64_t>{"10:2", 10, 2},
        {"0:1", 0, 1},
        {"7", 0, 7},
        {"007:010", 7, 10},
        {"123456789012:345678901234", 123456789012, 345678901234}}) {
    ::setenv("TORCHRPC_TRACE_STEPS", text, 1);
    options = rpc::Options::fromEnvironment();
    EXPECT_EQ(options.traceFirstStep, first) << text;
    EXPECT_EQ(options.traceStepCount, count) << text;
  }
}

TEST_F(
    OptionsFromEnvironment,
    MalformedTraceStepsAreRefusedNamingTheVariableAndValue) {
  for (const char* text :
       {"x", "2:0", "0", "-1:2", ":3", "3:", ":", "1:2:3", "1.5", "2:x"}) {
    expectRefusedNaming("TORCHRPC_TRACE_STEPS", text);
  }
}

// A window the Tracer could not hold (Tracer::traceSteps needs first +
// count in an int64) is refused here, naming the variable, and not later
// by the DistributedOptimizer that arms the window. The launcher's
// --trace-steps refuses the same values (rpc/trace_steps.h).
TEST_F(OptionsFromEnvironment, TraceStepsBeyondInt64AreRefusedWhenRead) {
  ::setenv("TORCHRPC_TRACE_STEPS", "99999999999999999999:1", 1);
  EXPECT_EQ(
      errorOfFromEnvironment(),
      "TORCHRPC_TRACE_STEPS must be FIRST:COUNT, or COUNT for FIRST 0, in "
      "decimal digits, with COUNT > 0 and FIRST + COUNT at most 2^63 - 1, "
      "got '99999999999999999999:1'");
  for (const char* text :
       {"1:99999999999999999999",
        "9223372036854775808",
        "1:9223372036854775807",
        "9223372036854775807:1",
        "+5",
        " 5",
        "1: 2"}) {
    expectRefusedNaming("TORCHRPC_TRACE_STEPS", text);
  }
  // The largest windows there are.
  ::setenv("TORCHRPC_TRACE_STEPS", "9223372036854775806:1", 1);
  rpc::Options options = rpc::Options::fromEnvironment();
  EXPECT_EQ(options.traceFirstStep, 9223372036854775806);
  EXPECT_EQ(options.traceStepCount, 1);
  ::setenv("TORCHRPC_TRACE_STEPS", "9223372036854775807", 1);
  options = rpc::Options::fromEnvironment();
  EXPECT_EQ(options.traceFirstStep, 0);
  EXPECT_EQ(options.traceStepCount, 9223372036854775807);
}

TEST_F(OptionsFromEnvironment, TraceMaxEventsIsAnEventCount) {
  EXPECT_EQ(rpc::Options::fromEnvironment().traceMaxEvents, 1000000u);
  ::setenv("TORCHRPC_TRACE_MAX_EVENTS", "2500", 1);
  EXPECT_EQ(rpc::Options::fromEnvironment().traceMaxEvents, 2500u);
  ::setenv("TORCHRPC_TRACE_MAX_EVENTS", "0", 1);
  EXPECT_EQ(rpc::Options::fromEnvironment().traceMaxEvents, 0u);
}

TEST_F(
    OptionsFromEnvironment,
    MalformedTraceMaxEventsAreRefusedNamingTheVariableAndValue) {
  ::setenv("TORCHRPC_TRACE_MAX_EVENTS", "many", 1);
  EXPECT_EQ(
      errorOfFromEnvironment(),
      "environment variable TORCHRPC_TRACE_MAX_EVENTS must be an integer, "
      "got 'many'");
  ::setenv("TORCHRPC_TRACE_MAX_EVENTS", "-1", 1);
  EXPECT_EQ(
      errorOfFromEnvironment(),
      "TORCHRPC_TRACE_MAX_EVENTS must not be negative, got '-1'");
  for (const char* text : {"1e6", "12 ", "0x10"}) {
    expectRefusedNaming("TORCHRPC_TRACE_MAX_EVENTS", text);
  }
  // strtoll would clamp it to 2^63 - 1, which is no cap at all.
  ::setenv("TORCHRPC_TRACE_MAX_EVENTS", "99999999999999999999", 1);
  EXPECT_EQ(
      errorOfFromEnvironment(),
      "environment variable TORCHRPC_TRACE_MAX_EVENTS must be an integer "
      "that fits in 64 bits, got '99999999999999999999'");
}

// A malformed address is refused when the Runtime is made, naming
// Options::metricsAddress and TORCHRPC_METRICS_ADDR (metrics_test.cpp,
// MetricsEndpointTest.AMalformedAddressIsRefusedNamingTheOption): the
// Runtime checks the field however it was set.
TEST_F(OptionsFromEnvironment, MetricsAddressIsTheVariableAsGiven) {
  EXPECT_EQ(rpc::Options::fromEnvironment().metricsAddress, "");
  for (const char* address :
       {"127.0.0.1:9100", "0.0.0.0:0", "worker-3.example:9101"}) {
    ::setenv("TORCHRPC_METRICS_ADDR", address, 1);
    EXPECT_EQ(rpc::Options::fromEnvironment().metricsAddress, address);
  }
  ::setenv("TORCHRPC_METRICS_ADDR", "", 1);
  EXPECT_EQ(rpc::Options::fromEnvironment().metricsAddress, "");
}

class SameHostOptionsFromEnvironment : public ::testing::Test {
 protected:
  testing::ScopedLauncherEnv launcher_;
  testing::ScopedEnv sameHost_{
      "TORCHRPC_SAME_HOST",
      "TORCHRPC_SHARED_MEMORY_MAX_BYTES",
      "TORCHRPC_COPY_HELPER_MIN_BYTES",
      "TORCHRPC_SHARED_RING_BYTES"};
};

TEST_F(SameHostOptionsFromEnvironment, UnsetTheyAreTheDefaults) {
  rpc::Options options = rpc::Options::fromEnvironment();
  EXPECT_TRUE(options.sameHostTransfers);
  EXPECT_EQ(options.sharedMemoryMaxBytes, size_t(1) << 30);
  EXPECT_EQ(options.copyHelperMinBytes, size_t(1) << 20);
  EXPECT_EQ(options.sharedRingBytes, size_t(256) << 10);
}

TEST_F(SameHostOptionsFromEnvironment, EachSetsItsField) {
  ::setenv("TORCHRPC_SAME_HOST", "0", 1);
  ::setenv("TORCHRPC_SHARED_MEMORY_MAX_BYTES", "67108864", 1);
  ::setenv("TORCHRPC_COPY_HELPER_MIN_BYTES", "0", 1);
  ::setenv("TORCHRPC_SHARED_RING_BYTES", "0", 1);
  rpc::Options options = rpc::Options::fromEnvironment();
  EXPECT_EQ(options.sharedRingBytes, 0u);
  EXPECT_FALSE(options.sameHostTransfers);
  EXPECT_EQ(options.sharedMemoryMaxBytes, size_t(64) << 20);
  EXPECT_EQ(options.copyHelperMinBytes, 0u);
  ::setenv("TORCHRPC_SAME_HOST", "1", 1);
  ::setenv("TORCHRPC_SHARED_MEMORY_MAX_BYTES", "0", 1);
  ::setenv("TORCHRPC_COPY_HELPER_MIN_BYTES", "4194304", 1);
  ::setenv("TORCHRPC_SHARED_RING_BYTES", "1048576", 1);
  options = rpc::Options::fromEnvironment();
  EXPECT_EQ(options.sharedRingBytes, size_t(1) << 20);
  EXPECT_TRUE(options.sameHostTransfers);
  EXPECT_EQ(options.sharedMemoryMaxBytes, 0u);
  EXPECT_EQ(options.copyHelperMinBytes, size_t(4) << 20);
}

TEST_F(
    SameHostOptionsFromEnvironment,
    MalformedValuesAreRefusedNamingTheVariableAndValue) {
  for (const char* text : {"yes", "true", "2", "-1", " 1"}) {
    expectRefusedNaming("TORCHRPC_SAME_HOST", text);
  }
  ::unsetenv("TORCHRPC_SAME_HOST");
  ::setenv("TORCHRPC_SHARED_MEMORY_MAX_BYTES", "-1", 1);
  EXPECT_EQ(
      errorOfFromEnvironment(),
      "environment variable TORCHRPC_SHARED_MEMORY_MAX_BYTES must be a byte "
      "count, not negative, got '-1'");
  for (const char* text : {"1G", "1e9", "lots"}) {
    expectRefusedNaming("TORCHRPC_SHARED_MEMORY_MAX_BYTES", text);
  }
  ::unsetenv("TORCHRPC_SHARED_MEMORY_MAX_BYTES");
  for (const char* text : {"-4096", "1MiB", "99999999999999999999"}) {
    expectRefusedNaming("TORCHRPC_COPY_HELPER_MIN_BYTES", text);
  }
  ::unsetenv("TORCHRPC_COPY_HELPER_MIN_BYTES");
  for (const char* text : {"-1", "256K", "lots"}) {
    expectRefusedNaming("TORCHRPC_SHARED_RING_BYTES", text);
  }
}

} // namespace
} // namespace torchrpc
