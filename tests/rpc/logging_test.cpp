// What a worker's stderr shows: libtorch's logging is initialised for the
// user, so glog's "Logging before InitGoogleLogging()" banner never appears.
// Logging state is per process and set once, so each case runs in a fresh
// process: this binary again, running one disabled test.

#include <c10/util/Logging.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/this_binary.h"
#include "torchrpc/rpc/log_level.h"
#include "torchrpc/rpc/runtime.h"
#include "torchrpc/rpc/transport/inprocess/inprocess_transport.h"

namespace torchrpc {
namespace {

const char* const kBanner = "Logging before InitGoogleLogging()";
const char* const kProbe = "torchrpc logging probe";

struct ChildResult {
  int exitCode = -1; // -1: killed at the deadline
  std::string stderrText;
};

// Runs this test binary on `test` alone (a DISABLED_ one) in a new process
// whose stdout and stderr go to a file, without GLOG_* variables so that glog's
// defaults apply (nor gtest's sharding ones). Waits 30 s at most, then kills
// the child by pid.
ChildResult runThisBinaryOn(
    const std::string& test,
    std::string extraVariable = "") {
  auto path = std::filesystem::temp_directory_path() /
      ("torchrpc_logging_test_" + std::to_string(::getpid()));
  std::string stderrPath = path.string();
  // Everything the child needs is built before fork(): after it, only
  // async-signal-safe calls.
  std::vector<std::string> extra;
  if (!extraVariable.empty()) {
    extra.push_back(std::move(extraVariable));
  }
  testing::ThisBinaryOnOneTest command(test, std::move(extra), {"GLOG_"});
  int fd = ::open(stderrPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  EXPECT_GE(fd, 0) << stderrPath;
  if (fd < 0) {
    return {};
  }
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fd, STDOUT_FILENO);
    ::dup2(fd, STDERR_FILENO);
    command.exec();
  }
  ::close(fd);
  ChildResult result;
  EXPECT_GT(pid, 0) << "fork failed";
  if (pid > 0) {
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    for (;;) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        result.exitCode = WIFEXITED(status) ? WEXITSTATUS(status) : 128;
        break;
      }
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  std::ifstream in(stderrPath);
  result.stderrText.assign(
      std::istreambuf_iterator<char>(in),
      std::istreambuf_iterator<char>());
  std::filesystem::remove(path);
  return result;
}

// The child: a user's program that constructs a Runtime, then something
// logs through libtorch.
TEST(LoggingChild, DISABLED_LogsAfterConstructingARuntime) {
  rpc::Options options;
  options.inProcessNetwork = std::make_shared<rpc::InProcessNetwork>();
  rpc::Runtime runtime("w", options);
  LOG(WARNING) << kProbe;
}

TEST(Logging, NoBannerAndMessagesStillReachStderr) {
  auto child =
      runThisBinaryOn("LoggingChild.DISABLED_LogsAfterConstructingARuntime");
  EXPECT_EQ(child.exitCode, 0) << child.stderrText;
  EXPECT_EQ(child.stderrText.find(kBanner), std::string::npos)
      << child.stderrText;
  // Initialising glog must not send messages away from stderr (by default
  // it would write them to files instead).
  EXPECT_NE(child.stderrText.find(kProbe), std::string::npos)
      << child.stderrText;
}

// The child: two workers, a call whose caller gives up, a call that works.
TEST(LoggingChild, DISABLED_TwoWorkersAndATimeout) {
  auto network = std::make_shared<rpc::InProcessNetwork>();
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::unique_ptr<rpc::Runtime>> workers;
  for (int rank = 0; rank < 2; ++rank) {
    rpc::Options options;
    options.rank = rank;
    options.worldSize = 2;
    options.store = store;
    options.inProcessNetwork = network;
    options.numWorkerThreads = 1;
    workers.push_back(std::make_unique<rpc::Runtime>(
        "worker" + std::to_string(rank),
        options));
    workers.back()->functions().add("sleep_ms", [](int64_t ms) {
      std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      return ms;
    });
  }
  std::thread other([&]() { workers[1]->start(); });
  workers[0]->start();
  other.join();
  auto slow = workers[0]
                  ->withTimeout(std::chrono::milliseconds(50))
                  .rpcAsync<int64_t>("worker1", "sleep_ms", 300);
  auto queued = workers[0]
                    ->withTimeout(std::chrono::milliseconds(50))
                    .rpcAsync<int64_t>("worker1", "sleep_ms", 1);
  EXPECT_THROW(slow.wait(), rpc::RpcError);
  EXPECT_THROW(queued.wait(), rpc::RpcError);
  EXPECT_EQ(
      workers[0]
          ->withTimeout(std::chrono::seconds(10))
          .rpcSync<int64_t>("worker1", "sleep_ms", 1),
      1);
  std::thread stop([&]() { workers[1]->shutdown(); });
  workers[0]->shutdown();
  stop.join();
}

TEST(Logging, DebugLevelNamesEveryEventAndTheDefaultDoesNot) {
  auto debug = runThisBinaryOn(
      "LoggingChild.DISABLED_TwoWorkersAndATimeout",
      "TORCHRPC_LOG_LEVEL=debug");
  EXPECT_EQ(debug.exitCode, 0) << debug.stderrText;
  for (const char* expected :
       {"[torchrpc debug] worker0: connecting to 'worker1' (id 1) at ",
        "[torchrpc debug] worker1: cancel of request #",
        "[torchrpc debug] worker1: dropped request #",
        "(sleep_ms) from 'worker0' unrun: its caller gave up",
        "[torchrpc debug] worker1: response to request #"}) {
    EXPECT_NE(debug.stderrText.find(expected), std::string::npos)
        << "'" << expected << "' not in:\n"
        << debug.stderrText;
  }
  auto quiet = runThisBinaryOn("LoggingChild.DISABLED_TwoWorkersAndATimeout");
  EXPECT_EQ(quiet.exitCode, 0) << quiet.stderrText;
  EXPECT_EQ(quiet.stderrText.find("[torchrpc debug]"), std::string::npos)
      << quiet.stderrText;
  // Timeouts are warnings: at the default level they show.
  EXPECT_NE(quiet.stderrText.find("timed out"), std::string::npos)
      << quiet.stderrText;
  auto wrong = runThisBinaryOn(
      "LoggingChild.DISABLED_TwoWorkersAndATimeout",
      "TORCHRPC_LOG_LEVEL=chatty");
  EXPECT_EQ(wrong.exitCode, 0) << wrong.stderrText;
  EXPECT_NE(
      wrong.stderrText.find("TORCHRPC_LOG_LEVEL is 'chatty', not one of "
                            "debug, info, warning, error; using warning"),
      std::string::npos)
      << wrong.stderrText;
  auto errorsOnly = runThisBinaryOn(
      "LoggingChild.DISABLED_TwoWorkersAndATimeout",
      "TORCHRPC_LOG_LEVEL=ERROR");
  EXPECT_EQ(errorsOnly.exitCode, 0) << errorsOnly.stderrText;
  EXPECT_EQ(errorsOnly.stderrText.find("timed out"), std::string::npos)
      << errorsOnly.stderrText;
}

TEST(Logging, LevelNamesParse) {
  rpc::LogLevel level = rpc::LogLevel::kError;
  EXPECT_TRUE(rpc::parseLogLevel("Debug", &level));
  EXPECT_EQ(level, rpc::LogLevel::kDebug);
  EXPECT_TRUE(rpc::parseLogLevel("warning", &level));
  EXPECT_EQ(level, rpc::LogLevel::kWarning);
  EXPECT_FALSE(rpc::parseLogLevel("warn", &level));
  EXPECT_FALSE(rpc::parseLogLevel("", &level));
  EXPECT_FALSE(rpc::parseLogLevel(nullptr, &level));
}

#ifdef C10_USE_GLOG
// The child: an application that configured glog itself (messages to files
// under TORCHRPC_TEST_LOG_DIR only) before constructing a Runtime.
TEST(LoggingChild, DISABLED_ApplicationInitialisedGlogFirst) {
  const char* dir = std::getenv("TORCHRPC_TEST_LOG_DIR");
  ASSERT_NE(dir, nullptr);
  FLAGS_log_dir = dir;
  FLAGS_logtostderr = false;
  google::InitGoogleLogging("application");
  rpc::Options options;
  options.inProcessNetwork = std::make_shared<rpc::InProcessNetwork>();
  // glog aborts on a second initialisation; the Runtime must not attempt one.
  rpc::Runtime runtime("w", options);
  EXPECT_FALSE(FLAGS_logtostderr);
  LOG(WARNING) << kProbe;
}

TEST(Logging, AnApplicationsOwnGlogConfigurationStands) {
  auto dir = std::filesystem::temp_directory_path() /
      ("torchrpc_logging_dir_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  auto child = runThisBinaryOn(
      "LoggingChild.DISABLED_ApplicationInitialisedGlogFirst",
      "TORCHRPC_TEST_LOG_DIR=" + dir.string());
  std::filesystem::remove_all(dir);
  EXPECT_EQ(child.exitCode, 0) << child.stderrText;
  EXPECT_EQ(child.stderrText.find(kBanner), std::string::npos)
      << child.stderrText;
  // A warning goes to the application's log files, not to stderr.
  EXPECT_EQ(child.stderrText.find(kProbe), std::string::npos)
      << child.stderrText;
}
#endif

} // namespace
} // namespace torchrpc
