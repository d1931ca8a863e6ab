#pragma once

// Runs this test binary again, on one (disabled) test, in a forked child.
//
// Why exec and not run on after fork: a child forked from a process with
// threads may take only async-signal-safe steps until it execs. A child that
// runs on (allocates, logs, starts a transport) can block forever on a lock
// that another thread of the parent held at the fork. Tests whose fixtures
// already run threads therefore exec: the command line and the environment
// are built before fork(), and the child only calls execve().

#include <unistd.h>

#include <string>
#include <vector>

extern char** environ;

namespace torchrpc {
namespace testing {

class ThisBinaryOnOneTest {
 public:
  // `test` is a full gtest name ("Suite.DISABLED_Name"). The child inherits
  // this process's environment except gtest's sharding variables (as a
  // shard's child it would run only its share of the one test, perhaps
  // nothing) and variables starting with any of `droppedPrefixes`; then
  // `extraVariables` ("NAME=value") are added.
  explicit ThisBinaryOnOneTest(
      const std::string& test,
      std::vector<std::string> extraVariables = {},
      const std::vector<std::string>& droppedPrefixes = {})
      : self_("/proc/self/exe"),
        filter_("--gtest_filter=" + test),
        alsoDisabled_("--gtest_also_run_disabled_tests"),
        extra_(std::move(extraVariables)) {
    argv_ = {self_.data(), filter_.data(), alsoDisabled_.data(), nullptr};
    std::vector<std::string> dropped = droppedPrefixes;
    dropped.push_back("GTEST_SHARD_INDEX=");
    dropped.push_back("GTEST_TOTAL_SHARDS=");
    dropped.push_back("GTEST_SHARD_STATUS_FILE=");
    for (char** e = environ; *e != nullptr; ++e) {
      bool keep = true;
      for (const std::string& prefix : dropped) {
        if (std::string(*e).rfind(prefix, 0) == 0) {
          keep = false;
        }
      }
      if (keep) {
        envp_.push_back(*e);
      }
    }
    for (std::string& variable : extra_) {
      envp_.push_back(variable.data());
    }
    envp_.push_back(nullptr);
  }

  ThisBinaryOnOneTest(const ThisBinaryOnOneTest&) = delete;
  ThisBinaryOnOneTest& operator=(const ThisBinaryOnOneTest&) = delete;

  // In the forked child: becomes this binary on the test; exit status 127 if
  // that fails. Async-signal-safe.
  [[noreturn]] void exec() const {
    ::execve(self_.c_str(), argv_.data(), envp_.data());
    ::_exit(127);
  }

 private:
  std::string self_;
  std::string filter_;
  std::string alsoDisabled_;
  std::vector<std::string> extra_;
  std::vector<char*> argv_;
  std::vector<char*> envp_;
};

} // namespace testing
} // namespace torchrpc
