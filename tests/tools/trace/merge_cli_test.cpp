#include "merge_cli.h"

#include <fstream>
#include <sstream>
#include <vector>

#include <gtest/gtest.h>

#include "synthetic_job.h"
#include "temp_dir.h"

namespace torchrpc {
namespace trace {
namespace {

using nlohmann::json;
using testing::CallOptions;
using testing::SyntheticJob;
using testing::TempDir;

struct ToolRun {
  int status;
  std::string out;
  std::string err;
};

ToolRun runTool(std::vector<std::string> args) {
  args.insert(args.begin(), "torchrpc-trace-merge");
  std::vector<const char*> argv;
  for (const auto& a : args) {
    argv.push_back(a.c_str());
  }
  std::ostringstream out;
  std::ostringstream err;
  int status =
      runTraceMerge(static_cast<int>(argv.size()), argv.data(), out, err);
  return {status, out.str(), err.str()};
}

SyntheticJob twoWorkers() {
  SyntheticJob job;
  job.addWorker("ps0", 0, 0);
  job.addWorker("trainer0", 1, 5e6);
  job.call(1, 0, 100, 40, 50, 40);
  job.call(0, 1, 1000, 40, 50, 40);
  return job;
}

TEST(TraceMergeCli, MergesADirectoryAndPrintsTheSummary) {
  TempDir dir;
  twoWorkers().writeFiles(dir.path());
  std::string merged = dir.path() + "/merged.json";
  ToolRun r = runTool({"-o", merged, dir.path()});
  EXPECT_EQ(r.status, kExitOk) << r.err;
  EXPECT_NE(r.out.find("workers: 2"), std::string::npos) << r.out;
  EXPECT_NE(
      r.out.find("calls: 2 matched, 0 client side only"),
      std::string::npos)
      << r.out;
  std::ifstream in(merged);
  json doc = json::parse(in);
  EXPECT_EQ(doc["otherData"]["alignment"], "feasible");
  EXPECT_NEAR(
      doc["otherData"]["workers"]["trainer0"]["offset_us"].get<double>(),
      5e6,
      80);
  EXPECT_EQ(doc["otherData"]["pairs"][0]["samples"], 2);
}

TEST(TraceMergeCli, CheckPasses) {
  TempDir dir;
  twoWorkers().writeFiles(dir.path());
  ToolRun r = runTool({"--check", dir.path()});
  EXPECT_EQ(r.status, kExitOk) << r.err;
  EXPECT_NE(r.out.find("check passed"), std::string::npos) << r.out;
}

TEST(TraceMergeCli, CheckFailsNamingTheUnmatchedCall) {
  TempDir dir;
  SyntheticJob job = twoWorkers();
  CallOptions clientOnly;
  clientOnly.writeServerSide = false;
  std::string lost = job.call(1, 0, 3000, 40, 50, 40, clientOnly).id;
  job.writeFiles(dir.path());
  std::string merged = dir.path() + "/merged.json";
  ToolRun r = runTool({"--check", "-o", merged, dir.path()});
  EXPECT_EQ(r.status, kExitCheckFailed);
  EXPECT_NE(r.err.find("check failed: 1 problem"), std::string::npos) << r.err;
  EXPECT_NE(
      r.err.find("call " + lost + ": trainer0 got a reply from ps0"),
      std::string::npos)
      << r.err;
  // The merged file is still written, for a look at what went wrong.
  EXPECT_TRUE(std::ifstream(merged).good());
  // Without --check the same input merges fine.
  EXPECT_EQ(runTool({"-o", merged, dir.path()}).status, kExitOk);
}

TEST(TraceMergeCli, CheckFailsOnACallWithNeitherReplyNorError) {
  TempDir dir;
  SyntheticJob job = twoWorkers();
  CallOptions noReply;
  noReply.replyArrives = false;
  noReply.clientError = "";
  std::string call = job.call(1, 0, 3000, 40, 50, 40, noReply).id;
  job.writeFiles(dir.path());
  ToolRun r = runTool({"--check", dir.path()});
  EXPECT_EQ(r.status, kExitCheckFailed);
  EXPECT_NE(r.err.find("check failed: 1 problem"), std::string::npos) << r.err;
  EXPECT_NE(
      r.err.find(
          "call " + call +
          ": trainer0's call to ps0 (fn fn2) has neither a reply (t_reply) "
          "nor an error"),
      std::string::npos)
      << r.err;
}

TEST(TraceMergeCli, CheckFailsOnMessagesOutOfOrder) {
  TempDir dir;
  SyntheticJob job = twoWorkers();
  CallOptions corrupt;
  corrupt.corruptRecvUs = -1e6;
  job.call(0, 1, 5000, 40, 50, 40, corrupt);
  job.writeFiles(dir.path());
  ToolRun r = runTool({"--check", dir.path()});
  EXPECT_EQ(r.status, kExitCheckFailed);
  EXPECT_NE(r.err.find("before it was sent"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("alignment: infeasible"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("warning: no clock offsets"), std::string::npos)
      << r.out;
}

TEST(TraceMergeCli, BadInputExitsNamingTheFile) {
  TempDir dir;
  SyntheticJob job = twoWorkers();
  job.writeFiles(dir.path());
  std::string victim = dir.path() + "/" + job.fileName(1);
  std::string text = job.document(1).dump();
  std::ofstream(victim, std::ios::trunc) << text.substr(0, text.size() / 3);
  ToolRun r = runTool({"-o", dir.path() + "/merged.json", dir.path()});
  EXPECT_EQ(r.status, kExitBadInput);
  EXPECT_NE(r.err.find(victim + ": truncated"), std::string::npos) << r.err;
  EXPECT_FALSE(std::ifstream(dir.path() + "/merged.json").good());
}

TEST(TraceMergeCli, DuplicateWorkerFilesAreRefused) {
  TempDir dir;
  SyntheticJob job = twoWorkers();
  job.writeFiles(dir.path());
  std::filesystem::copy_file(
      dir.path() + "/ps0.trace.json",
      dir.path() + "/ps0-again.trace.json");
  ToolRun r = runTool({"--check", dir.path()});
  EXPECT_EQ(r.status, kExitBadInput);
  EXPECT_NE(r.err.find("duplicate worker \"ps0\""), std::string::npos) << r.err;
}

TEST(TraceMergeCli, UsageErrors) {
  TempDir dir;
  twoWorkers().writeFiles(dir.path());
  ToolRun noOutput = runTool({dir.path()});
  EXPECT_EQ(noOutput.status, kExitBadInput);
  EXPECT_NE(noOutput.err.find("-o FILE is needed"), std::string::npos);
  EXPECT_EQ(runTool({"-o", dir.path() + "/m.json"}).status, kExitBadInput);
  EXPECT_EQ(runTool({"--bogus", dir.path()}).status, kExitBadInput);
  EXPECT_EQ(runTool({"--help"}).status, kExitOk);
}

TEST(TraceMergeCli, SkipsItsOwnOutputInTheInputDirectory) {
  TempDir dir;
  twoWorkers().writeFiles(dir.path());
  std::string merged = dir.path() + "/all.trace.json";
  ASSERT_EQ(runTool({"-o", merged, dir.path()}).status, kExitOk);
  ToolRun again = runTool({"-o", merged, dir.path()});
  EXPECT_EQ(again.status, kExitOk) << again.err;
}

} // namespace
} // namespace trace
} // namespace torchrpc
