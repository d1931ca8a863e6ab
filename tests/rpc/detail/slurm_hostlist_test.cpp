// Slurm's compressed host lists and tasks-per-node lists, as srun and sbatch
// write them into SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE.

#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include "torchrpc/rpc/detail/slurm_hostlist.h"

namespace torchrpc {
namespace {

using rpc::detail::expandSlurmHostlist;
using rpc::detail::expandSlurmTasksPerNode;
using Hosts = std::vector<std::string>;

std::string errorOf(const std::string& hostlist) {
  try {
    expandSlurmHostlist(hostlist);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

TEST(SlurmHostlist, SingleHostsAndCommasAtTheTopLevel) {
  EXPECT_EQ(expandSlurmHostlist("gpu5"), Hosts({"gpu5"}));
  EXPECT_EQ(expandSlurmHostlist("a,b,c"), Hosts({"a", "b", "c"}));
  EXPECT_EQ(
      expandSlurmHostlist("node-1.cluster,node-2.cluster"),
      Hosts({"node-1.cluster", "node-2.cluster"}));
}

TEST(SlurmHostlist, RangesKeepTheirZeroPaddingInOrder) {
  EXPECT_EQ(
      expandSlurmHostlist("node[01-03,07],gpu5"),
      Hosts({"node01", "node02", "node03", "node07", "gpu5"}));
  EXPECT_EQ(expandSlurmHostlist("n[8-11]"), Hosts({"n8", "n9", "n10", "n11"}));
  EXPECT_EQ(expandSlurmHostlist("n[098-100]"), Hosts({"n098", "n099", "n100"}));
  EXPECT_EQ(expandSlurmHostlist("n[5]"), Hosts({"n5"}));
}

TEST(SlurmHostlist, SeveralBracketsMultiplyOutLastFastest) {
  EXPECT_EQ(
      expandSlurmHostlist("rack[1-2]-n[1-2],x"),
      Hosts({"rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2", "x"}));
  EXPECT_EQ(
      expandSlurmHostlist("a[1,3]b.suffix"),
      Hosts({"a1b.suffix", "a3b.suffix"}));
}

TEST(SlurmHostlist, MalformedListsSayWhatIsWrong) {
  EXPECT_NE(errorOf("node[01-03").find("unclosed '['"), std::string::npos);
  EXPECT_NE(errorOf("node01]").find("']' without '['"), std::string::npos);
  EXPECT_NE(errorOf("node[3-1]").find("range 3-1"), std::string::npos);
  EXPECT_NE(errorOf("node[a-b]").find("numbers and ranges"), std::string::npos);
  EXPECT_NE(errorOf("node[]").find("numbers and ranges"), std::string::npos);
  EXPECT_NE(errorOf("a,,b").find("empty host name"), std::string::npos);
  EXPECT_NE(errorOf("").find("empty host name"), std::string::npos);
  EXPECT_NE(errorOf("n[0-99999999]").find("too large"), std::string::npos);
  EXPECT_NE(errorOf("n[1-2]").find("no error"), std::string::npos);
}

TEST(SlurmTasksPerNode, RepeatsExpand) {
  using Counts = std::vector<int64_t>;
  EXPECT_EQ(expandSlurmTasksPerNode("4"), Counts({4}));
  EXPECT_EQ(expandSlurmTasksPerNode("2(x3),1"), Counts({2, 2, 2, 1}));
  EXPECT_EQ(expandSlurmTasksPerNode("1,2(x2)"), Counts({1, 2, 2}));
  EXPECT_THROW(expandSlurmTasksPerNode("2(x"), c10::Error);
  EXPECT_THROW(expandSlurmTasksPerNode("two"), c10::Error);
  EXPECT_THROW(expandSlurmTasksPerNode(""), c10::Error);
}

} // namespace
} // namespace torchrpc
