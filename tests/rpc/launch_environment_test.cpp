// Options::fromEnvironment() under each launcher: which one is detected,
// the identity it reads, the master it derives, and the errors that name
// the variable and the launcher.

#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include <csignal>
#include <cstdlib>
#include <utility>

#include "tests/support/scoped_env.h"
#include "torchrpc/rpc/detail/rendezvous.h"
#include "torchrpc/rpc/launch_environment.h"
#include "torchrpc/rpc/options.h"

namespace torchrpc {
namespace {

using rpc::LaunchEnvironment;
using rpc::Launcher;
using testing::errorOfFromEnvironment;
using testing::ScopedLauncherEnv;

void expectErrorNames(const std::string& variable, const char* launcher) {
  std::string message = errorOfFromEnvironment();
  EXPECT_NE(message.find(variable), std::string::npos) << message;
  EXPECT_NE(message.find(launcher), std::string::npos) << message;
}

TEST(LaunchEnvironment, HangReportSignalIsReadByName) {
  ScopedLauncherEnv env;
  struct Unset {
    ~Unset() {
      ::unsetenv("TORCHRPC_HANG_REPORT_SIGNAL");
    }
  } unset;
  EXPECT_EQ(rpc::Options::fromEnvironment().hangReportSignal, 0);
  for (auto [text, signal] :
       {std::pair{"USR1", SIGUSR1},
        std::pair{"SIGUSR1", SIGUSR1},
        std::pair{"USR2", SIGUSR2},
        std::pair{"SIGUSR2", SIGUSR2}}) {
    ::setenv("TORCHRPC_HANG_REPORT_SIGNAL", text, 1);
    EXPECT_EQ(rpc::Options::fromEnvironment().hangReportSignal, signal) << text;
  }
  ::setenv("TORCHRPC_HANG_REPORT_SIGNAL", "TERM", 1);
  EXPECT_EQ(
      errorOfFromEnvironment(),
      "TORCHRPC_HANG_REPORT_SIGNAL must be USR1 or USR2 (or empty for none), "
      "got 'TERM'");
}

TEST(LaunchEnvironment, NoLauncherIsRankZeroOfOne) {
  ScopedLauncherEnv env;
  auto o = rpc::Options::fromEnvironment();
  EXPECT_EQ(o.launch.launcher, Launcher::kNone);
  EXPECT_EQ(o.rank, 0);
  EXPECT_EQ(o.worldSize, 1);
  EXPECT_EQ(o.launch.localRank, 0);
  EXPECT_EQ(o.launch.localWorldSize, 1);
  EXPECT_EQ(o.launch.restartCount, 0);
  EXPECT_STREQ(rpc::launcherName(o.launch.launcher), "none");
}

TEST(LaunchEnvironment, TorchrunVariablesAreRead) {
  ScopedLauncherEnv env;
  env.set({
      {"RANK", "5"},
      {"WORLD_SIZE", "8"},
      {"LOCAL_RANK", "1"},
      {"LOCAL_WORLD_SIZE", "4"},
      {"GROUP_RANK", "1"},
      {"MASTER_ADDR", "10.0.0.1"},
      {"MASTER_PORT", "29400"},
      {"TORCHELASTIC_RESTART_COUNT", "2"},
      {"TORCHELASTIC_MAX_RESTARTS", "3"},
      {"TORCHELASTIC_RUN_ID", "job7"},
  });
  auto o = rpc::Options::fromEnvironment();
  EXPECT_EQ(o.launch.launcher, Launcher::kTorchrun);
  EXPECT_EQ(o.rank, 5);
  EXPECT_EQ(o.worldSize, 8);
  EXPECT_EQ(o.launch.localRank, 1);
  EXPECT_EQ(o.launch.localWorldSize, 4);
  EXPECT_EQ(o.launch.groupRank, c10::optional<int64_t>(1));
  EXPECT_EQ(o.launch.masterAddr, "10.0.0.1");
  EXPECT_EQ(o.launch.masterPort, 29400);
  EXPECT_EQ(o.launch.restartCount, 2);
  EXPECT_EQ(o.launch.maxRestarts, 3);
  EXPECT_EQ(o.launch.runId, "job7");
  EXPECT_EQ(o.initMethod, "env://");
}

TEST(LaunchEnvironment, RankAndWorldSizeAloneAreOneNode) {
  ScopedLauncherEnv env;
  env.set({{"RANK", "2"}, {"WORLD_SIZE", "3"}});
  auto launch = LaunchEnvironment::fromEnvironment();
  EXPECT_EQ(launch.launcher, Launcher::kTorchrun);
  EXPECT_EQ(launch.localRank, 2);
  EXPECT_EQ(launch.localWorldSize, 3);
  EXPECT_EQ(launch.groupRank, c10::optional<int64_t>(0));
  EXPECT_TRUE(launch.masterAddr.empty());
  EXPECT_EQ(launch.masterPort, 0);
}

TEST(LaunchEnvironment, TorchrunTakesPrecedenceOverOpenMpiAndSlurm) {
  ScopedLauncherEnv env;
  env.set({
      {"RANK", "1"},
      {"WORLD_SIZE", "2"},
      {"OMPI_COMM_WORLD_RANK", "0"},
      {"OMPI_COMM_WORLD_SIZE", "4"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
      {"SLURM_PROCID", "3"},
      {"SLURM_NTASKS", "4"},
      {"SLURM_LOCALID", "3"},
  });
  EXPECT_EQ(LaunchEnvironment::fromEnvironment().launcher, Launcher::kTorchrun);
  ::unsetenv("RANK");
  ::unsetenv("WORLD_SIZE");
  auto launch = LaunchEnvironment::fromEnvironment();
  EXPECT_EQ(launch.launcher, Launcher::kOpenMpi);
  EXPECT_EQ(launch.worldSize, 4);
}

TEST(LaunchEnvironment, TorchrunErrorsNameTheVariable) {
  ScopedLauncherEnv env;
  env.set({{"RANK", "0"}});
  expectErrorNames("WORLD_SIZE is not set", "torchrun");
  env.set({{"WORLD_SIZE", "two"}});
  expectErrorNames(
      "WORLD_SIZE (set by torchrun) must be a non-negative",
      "'two'");
  env.set({{"WORLD_SIZE", "2"}, {"RANK", "2"}});
  expectErrorNames("RANK (set by torchrun) must be below WORLD_SIZE", "'2'");
  env.set({{"RANK", "-1"}});
  expectErrorNames("RANK (set by torchrun)", "'-1'");
  env.set({{"RANK", "1"}, {"TORCHELASTIC_RUN_ID", "x"}});
  expectErrorNames("LOCAL_RANK is not set", "torchrun");
  env.set(
      {{"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "1"}, {"GROUP_RANK", "0"}});
  expectErrorNames("LOCAL_RANK (set by torchrun) must be below", "torchrun");
  env.set({{"LOCAL_WORLD_SIZE", "2"}, {"TORCHELASTIC_RESTART_COUNT", "x"}});
  expectErrorNames("TORCHELASTIC_RESTART_COUNT", "torchrun");
  env.set({{"TORCHELASTIC_RESTART_COUNT", "1"}, {"MASTER_PORT", "70000"}});
  expectErrorNames("MASTER_PORT (set by torchrun) must be a port", "70000");
  env.set({{"MASTER_PORT", "29500"}});
  EXPECT_EQ(errorOfFromEnvironment(), "no error");
}

TEST(LaunchEnvironment, OpenMpiOnOneNodeDefaultsToLoopback) {
  ScopedLauncherEnv env;
  env.set({
      {"OMPI_COMM_WORLD_RANK", "1"},
      {"OMPI_COMM_WORLD_SIZE", "2"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
  });
  auto o = rpc::Options::fromEnvironment();
  EXPECT_EQ(o.launch.launcher, Launcher::kOpenMpi);
  EXPECT_EQ(o.rank, 1);
  EXPECT_EQ(o.worldSize, 2);
  EXPECT_EQ(o.launch.localRank, 1);
  EXPECT_EQ(o.launch.localWorldSize, 2);
  EXPECT_FALSE(o.launch.groupRank.has_value());
  EXPECT_EQ(o.launch.masterAddr, "127.0.0.1");
  EXPECT_EQ(o.launch.masterPort, LaunchEnvironment::kDefaultMasterPort);
  env.set({{"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "4000"}});
  auto overridden = LaunchEnvironment::fromEnvironment();
  EXPECT_EQ(overridden.masterAddr, "10.1.2.3");
  EXPECT_EQ(overridden.masterPort, 4000);
}

TEST(LaunchEnvironment, OpenMpiAcrossNodesNeedsMasterAddr) {
  ScopedLauncherEnv env;
  env.set({
      {"OMPI_COMM_WORLD_RANK", "0"},
      {"OMPI_COMM_WORLD_SIZE", "4"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
  });
  auto o = rpc::Options::fromEnvironment();
  EXPECT_TRUE(o.launch.masterAddr.empty());
  try {
    rpc::detail::openStore(o);
    ADD_FAILURE() << "expected c10::Error";
  } catch (const c10::Error& e) {
    std::string message = e.what_without_backtrace();
    EXPECT_NE(message.find("MASTER_ADDR"), std::string::npos) << message;
    EXPECT_NE(message.find("Open MPI"), std::string::npos) << message;
  }
}

TEST(LaunchEnvironment, OpenMpiErrorsNameTheVariable) {
  ScopedLauncherEnv env;
  env.set({{"OMPI_COMM_WORLD_RANK", "0"}});
  expectErrorNames("OMPI_COMM_WORLD_SIZE is not set", "Open MPI");
  env.set({{"OMPI_COMM_WORLD_SIZE", "2"}});
  expectErrorNames("OMPI_COMM_WORLD_LOCAL_RANK is not set", "Open MPI");
  env.set({{"OMPI_COMM_WORLD_LOCAL_RANK", "x1"}});
  expectErrorNames("OMPI_COMM_WORLD_LOCAL_RANK (set by Open MPI)", "'x1'");
  env.set({{"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_RANK", "9"}});
  expectErrorNames("OMPI_COMM_WORLD_RANK (set by Open MPI) must be below", "9");
}

TEST(LaunchEnvironment, SlurmMasterIsTheFirstHostOfTheStep) {
  ScopedLauncherEnv env;
  env.set({
      {"SLURM_PROCID", "3"},
      {"SLURM_NTASKS", "6"},
      {"SLURM_LOCALID", "1"},
      {"SLURM_NODEID", "1"},
      {"SLURM_JOB_ID", "123456"},
      {"SLURM_JOB_NODELIST", "big[1-9]"},
      {"SLURM_STEP_NODELIST", "node[07-09],gpu5"},
      {"SLURM_STEP_TASKS_PER_NODE", "2(x3)"},
  });
  auto o = rpc::Options::fromEnvironment();
  EXPECT_EQ(o.launch.launcher, Launcher::kSlurm);
  EXPECT_EQ(o.rank, 3);
  EXPECT_EQ(o.worldSize, 6);
  EXPECT_EQ(o.launch.localRank, 1);
  EXPECT_EQ(o.launch.localWorldSize, 2);
  EXPECT_EQ(o.launch.groupRank, c10::optional<int64_t>(1));
  EXPECT_EQ(o.launch.masterAddr, "node07");
  EXPECT_EQ(o.launch.masterPort, 10000 + 3456);
  ::unsetenv("SLURM_STEP_NODELIST");
  EXPECT_EQ(LaunchEnvironment::fromEnvironment().masterAddr, "big1");
  env.set({{"MASTER_ADDR", "head"}, {"MASTER_PORT", "5555"}});
  auto overridden = LaunchEnvironment::fromEnvironment();
  EXPECT_EQ(overridden.masterAddr, "head");
  EXPECT_EQ(overridden.masterPort, 5555);
}

TEST(LaunchEnvironment, SlurmErrorsNameTheVariable) {
  ScopedLauncherEnv env;
  env.set({{"SLURM_PROCID", "0"}});
  expectErrorNames("SLURM_NTASKS is not set", "Slurm");
  env.set({{"SLURM_NTASKS", "2"}});
  expectErrorNames("SLURM_LOCALID is not set", "Slurm");
  env.set({{"SLURM_LOCALID", "0"}});
  expectErrorNames("SLURM_JOB_NODELIST is not set", "Slurm");
  env.set({{"SLURM_JOB_NODELIST", "node[01-"}});
  expectErrorNames("SLURM_JOB_NODELIST (set by Slurm)", "unclosed");
  env.set({{"SLURM_JOB_NODELIST", "node[01-02]"}});
  expectErrorNames("SLURM_JOB_ID is not set", "Slurm");
  env.set({{"SLURM_JOB_ID", "77"}, {"SLURM_TASKS_PER_NODE", "1(x"}});
  expectErrorNames("SLURM_TASKS_PER_NODE (set by Slurm)", "tasks per node");
  env.set({{"SLURM_TASKS_PER_NODE", "1"}, {"SLURM_NODEID", "1"}});
  expectErrorNames(
      "SLURM_TASKS_PER_NODE (set by Slurm) must have an entry",
      "Slurm");
  env.set({{"SLURM_TASKS_PER_NODE", "1(x2)"}});
  auto launch = LaunchEnvironment::fromEnvironment();
  EXPECT_EQ(launch.masterAddr, "node01");
  EXPECT_EQ(launch.masterPort, 10077);
  EXPECT_EQ(launch.localWorldSize, 1);
}

} // namespace
} // namespace torchrpc
