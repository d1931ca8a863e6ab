#pragma once

#include <cstdlib>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>

#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include "torchrpc/rpc/options.h"

namespace torchrpc {
namespace testing {

// Every variable a launcher sets that Options::fromEnvironment() reads.
inline const std::initializer_list<const char*>& launcherVariables() {
  static const std::initializer_list<const char*> names = {
      "RANK",
      "WORLD_SIZE",
      "LOCAL_RANK",
      "LOCAL_WORLD_SIZE",
      "GROUP_RANK",
      "MASTER_ADDR",
      "MASTER_PORT",
      "TORCHELASTIC_RESTART_COUNT",
      "TORCHELASTIC_MAX_RESTARTS",
      "TORCHELASTIC_RUN_ID",
      "TORCHELASTIC_USE_AGENT_STORE",
      "OMPI_COMM_WORLD_RANK",
      "OMPI_COMM_WORLD_SIZE",
      "OMPI_COMM_WORLD_LOCAL_RANK",
      "OMPI_COMM_WORLD_LOCAL_SIZE",
      "SLURM_PROCID",
      "SLURM_NTASKS",
      "SLURM_LOCALID",
      "SLURM_NODEID",
      "SLURM_JOB_ID",
      "SLURM_JOB_NODELIST",
      "SLURM_STEP_NODELIST",
      "SLURM_TASKS_PER_NODE",
      "SLURM_STEP_TASKS_PER_NODE",
  };
  return names;
}

// Clears the variables `names` for the lifetime of the object and puts back
// what was there before, so that a test's environment never leaks into the
// next (nor the environment that runs the tests into this one).
class ScopedEnv {
 public:
  explicit ScopedEnv(std::initializer_list<const char*> names) {
    for (const char* name : names) {
      const char* value = std::getenv(name);
      saved_.emplace(
          name,
          value == nullptr ? c10::nullopt
                           : c10::optional<std::string>(std::string(value)));
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    for (const auto& entry : saved_) {
      if (entry.second) {
        ::setenv(entry.first.c_str(), entry.second->c_str(), 1);
      } else {
        ::unsetenv(entry.first.c_str());
      }
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  void set(std::initializer_list<std::pair<const char*, const char*>> values) {
    for (const auto& value : values) {
      ::setenv(value.first, value.second, 1);
    }
  }

 private:
  std::map<std::string, c10::optional<std::string>> saved_;
};

// ScopedEnv over every launcher variable: what the launcher that runs the
// tests set cannot tell Options::fromEnvironment() who this process is.
class ScopedLauncherEnv : public ScopedEnv {
 public:
  ScopedLauncherEnv() : ScopedEnv(launcherVariables()) {}
};

// The message of the c10::Error that Options::fromEnvironment() throws,
// or "no error".
inline std::string errorOfFromEnvironment() {
  try {
    rpc::Options::fromEnvironment();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

} // namespace testing
} // namespace torchrpc
