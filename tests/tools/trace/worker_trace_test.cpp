#include "worker_trace.h"

#include <cstdio>
#include <filesystem>
#include <fstream>

#include <gtest/gtest.h>

#include "synthetic_job.h"
#include "temp_dir.h"

namespace torchrpc {
namespace trace {
namespace {

using nlohmann::json;
using testing::SyntheticJob;
using testing::TempDir;

// The message of the TraceInputError that parsing `text` as `file` throws.
std::string errorOf(
    const std::string& text,
    const std::string& file = "w.trace.json") {
  try {
    parseWorkerTrace(text, file);
  } catch (const TraceInputError& e) {
    return e.what();
  }
  ADD_FAILURE() << "accepted: " << text.substr(0, 200);
  return "";
}

json validDocument() {
  SyntheticJob job;
  job.addWorker("ps0", 0, 0);
  job.addWorker("trainer0", 1, 5e6);
  job.call(1, 0, 100, 40, 50, 40);
  job.flow(1, 0, 1000, 40);
  return job.document(1);
}

// Message starts with the file, then says the cause.
#define EXPECT_NAMES(message, cause)                  \
  do {                                                \
    std::string m = (message);                        \
    EXPECT_EQ(m.rfind("w.trace.json: ", 0), 0u) << m; \
    EXPECT_NE(m.find(cause), std::string::npos) << m; \
  } while (0)

TEST(WorkerTrace, ReadsTheContract) {
  WorkerTrace trace =
      parseWorkerTrace(validDocument().dump(), "trainer0.trace.json");
  EXPECT_EQ(trace.worker, "trainer0");
  EXPECT_EQ(trace.rank, 1);
  EXPECT_EQ(trace.clock, "steady");
  ASSERT_EQ(trace.clientSpans.size(), 1u);
  EXPECT_EQ(trace.clientSpans[0].call, "trainer0#1");
  EXPECT_EQ(trace.clientSpans[0].to, "ps0");
  EXPECT_TRUE(trace.clientSpans[0].tReply);
  EXPECT_FALSE(trace.clientSpans[0].error);
  EXPECT_EQ(trace.flowOuts.size(), 1u);
  EXPECT_TRUE(trace.serverSpans.empty());
}

TEST(WorkerTrace, NotJson) {
  EXPECT_NAMES(errorOf("hello"), "not JSON");
  EXPECT_NAMES(errorOf("{\"traceEvents\": [}"), "not JSON");
}

TEST(WorkerTrace, TruncatedByAKilledWorker) {
  std::string text = validDocument().dump(1);
  for (std::size_t cut : {text.size() / 2, text.size() - 1, std::size_t{1}}) {
    EXPECT_NAMES(errorOf(text.substr(0, cut)), "truncated");
  }
}

TEST(WorkerTrace, Empty) {
  EXPECT_NAMES(errorOf(""), "empty");
  EXPECT_NAMES(errorOf(" \n"), "empty");
}

TEST(WorkerTrace, NotATorchrpcTrace) {
  EXPECT_NAMES(errorOf("[]"), "not a torchrpc worker trace");
  EXPECT_NAMES(
      errorOf(R"({"traceEvents": []})"),
      "otherData.torchrpc_trace missing");
}

TEST(WorkerTrace, WrongVersion) {
  json doc = validDocument();
  doc["otherData"]["torchrpc_trace"] = 2;
  EXPECT_NAMES(errorOf(doc.dump()), "version 2, this tool reads version 1");
  doc["otherData"]["torchrpc_trace"] = "1";
  EXPECT_NAMES(errorOf(doc.dump()), "not an integer");
}

TEST(WorkerTrace, MissingWorkerOrRank) {
  json doc = validDocument();
  doc["otherData"].erase("worker");
  EXPECT_NAMES(errorOf(doc.dump()), "otherData.worker missing");
  doc = validDocument();
  doc["otherData"]["worker"] = "";
  EXPECT_NAMES(errorOf(doc.dump()), "otherData.worker is not");
  doc = validDocument();
  doc["otherData"].erase("rank");
  EXPECT_NAMES(errorOf(doc.dump()), "otherData.rank missing");
  doc = validDocument();
  doc["otherData"]["rank"] = -1;
  EXPECT_NAMES(errorOf(doc.dump()), "otherData.rank is not");
}

// The first event of `cat` in the document.
json& firstOf(json& doc, const std::string& cat) {
  for (auto& e : doc["traceEvents"]) {
    if (e.value("cat", "") == cat) {
      return e;
    }
  }
  throw std::runtime_error("no " + cat);
}

TEST(WorkerTrace, MissingRpcArgs) {
  for (const char* key : {"call", "to", "fn", "t_send"}) {
    json doc = validDocument();
    firstOf(doc, "rpc.client")["args"].erase(key);
    EXPECT_NAMES(errorOf(doc.dump()), std::string("args.") + key + " missing");
  }
  json doc = validDocument();
  firstOf(doc, "rpc.client")["args"].erase("t_send");
  EXPECT_NAMES(errorOf(doc.dump()), "rpc.client of call trainer0#1");

  SyntheticJob job;
  job.addWorker("ps0", 0, 0);
  job.addWorker("trainer0", 1, 0);
  job.call(1, 0, 100, 40, 50, 40);
  for (const char* key : {"call", "from", "fn", "t_recv"}) {
    json server = job.document(0);
    firstOf(server, "rpc.server")["args"].erase(key);
    EXPECT_NAMES(
        errorOf(server.dump()),
        std::string("args.") + key + " missing");
  }
  json server = job.document(0);
  firstOf(server, "rpc.server")["args"]["t_send_reply"] = "soon";
  EXPECT_NAMES(errorOf(server.dump()), "args.t_send_reply is not a number");
  server = job.document(0);
  firstOf(server, "rpc.server").erase("args");
  EXPECT_NAMES(errorOf(server.dump()), "args missing");
}

TEST(WorkerTrace, MalformedEvents) {
  json doc = validDocument();
  firstOf(doc, "rpc.client")["ph"] = "B";
  EXPECT_NAMES(errorOf(doc.dump()), "complete event");
  doc = validDocument();
  firstOf(doc, "rpc.client")["ts"] = "early";
  EXPECT_NAMES(errorOf(doc.dump()), "ts is not a number");
  doc = validDocument();
  firstOf(doc, "rpc.client").erase("dur");
  EXPECT_NAMES(errorOf(doc.dump()), "dur missing");
  doc = validDocument();
  doc["traceEvents"].push_back(42);
  EXPECT_NAMES(errorOf(doc.dump()), "not a JSON object");
  doc = validDocument();
  doc["traceEvents"].push_back({{"name", "x"}});
  EXPECT_NAMES(errorOf(doc.dump()), "ph missing");
  doc = validDocument();
  firstOf(doc, "rpc.client")["args"]["error"] = 4;
  EXPECT_NAMES(errorOf(doc.dump()), "args.error is not a non-empty string");
  doc = validDocument();
  firstOf(doc, "autograd")["args"]["flow_out"] = 7;
  EXPECT_NAMES(errorOf(doc.dump()), "args.flow_out is not a non-empty string");
  doc = validDocument();
  doc["traceEvents"] = "none";
  EXPECT_NAMES(errorOf(doc.dump()), "traceEvents missing or not an array");
}

TEST(WorkerTrace, DuplicateSpansInOneFile) {
  json doc = validDocument();
  doc["traceEvents"].push_back(firstOf(doc, "rpc.client"));
  EXPECT_NAMES(errorOf(doc.dump()), "two rpc.client spans for call trainer0#1");
  doc = validDocument();
  doc["traceEvents"].push_back(firstOf(doc, "autograd"));
  EXPECT_NAMES(errorOf(doc.dump()), "two events with args.flow_out");
}

TEST(WorkerTrace, DirectoriesStandForTheirTraceFiles) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  for (const char* name : {"b.trace.json", "a.trace.json", "notes.json"}) {
    std::ofstream(dir.path() + "/" + name) << "{}";
  }
  std::filesystem::create_directory(dir.path() + "/sub.trace.json");
  auto files = expandInputs({dir.path(), dir.path() + "/notes.json"});
  ASSERT_EQ(files.size(), 3u);
  EXPECT_EQ(files[0], dir.path() + "/a.trace.json");
  EXPECT_EQ(files[1], dir.path() + "/b.trace.json");
  EXPECT_EQ(files[2], dir.path() + "/notes.json");

  TempDir empty;
  try {
    expandInputs({empty.path()});
    FAIL();
  } catch (const TraceInputError& e) {
    EXPECT_NE(std::string(e.what()).find("no *.trace.json"), std::string::npos);
  }
  try {
    expandInputs({dir.path() + "/missing.trace.json"});
    FAIL();
  } catch (const TraceInputError& e) {
    EXPECT_NE(
        std::string(e.what()).find("missing.trace.json: no such"),
        std::string::npos)
        << e.what();
  }
}

TEST(WorkerTrace, UnreadableFileIsNamed) {
  try {
    readWorkerTrace("/nonexistent/x.trace.json");
    FAIL();
  } catch (const TraceInputError& e) {
    EXPECT_EQ(std::string(e.what()), "/nonexistent/x.trace.json: cannot open");
  }
}

} // namespace
} // namespace trace
} // namespace torchrpc
