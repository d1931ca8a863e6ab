#include "trace_merge.h"

#include <cmath>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include <gtest/gtest.h>

#include "synthetic_job.h"

namespace torchrpc {
namespace trace {
namespace {

using nlohmann::json;
using testing::CallOptions;
using testing::SyntheticJob;

double offsetOf(const MergeReport& report, const std::string& worker) {
  for (std::size_t w = 0; w < report.traces.size(); ++w) {
    if (report.traces[w].worker == worker) {
      return report.alignment.offsets[w];
    }
  }
  ADD_FAILURE() << "no worker " << worker;
  return NAN;
}

// Checks the ordering from the merged file itself: offsets from its
// otherData, times from the job's ground truth as the workers wrote them.
void expectEveryMessageOrdered(const SyntheticJob& job, const json& merged) {
  const json& workers = merged["otherData"]["workers"];
  for (const auto& c : job.calls()) {
    double oCaller = workers[job.name(c.caller)]["offset_us"];
    double oCallee = workers[job.name(c.callee)]["offset_us"];
    double sent = job.local(c.caller, c.send) - oCaller;
    double received = job.local(c.callee, c.recv) - oCallee;
    EXPECT_GE(received, sent - kOrderingToleranceUs)
        << "request of " << c.id << " received before it was sent";
    if (c.replyArrived) {
      double replySent = job.local(c.callee, c.sendReply) - oCallee;
      double replyReceived = job.local(c.caller, c.reply) - oCaller;
      EXPECT_GE(replyReceived, replySent - kOrderingToleranceUs)
          << "reply of " << c.id << " received before it was sent";
    }
  }
}

void expectOffsetsWithinRoundTrip(
    const SyntheticJob& job,
    const MergeReport& report) {
  for (std::size_t w = 1; w < job.workerCount(); ++w) {
    auto bound = job.minRoundTrip(0, w);
    ASSERT_TRUE(bound) << "the test job must link " << job.name(w)
                       << " to the reference";
    double truth = job.trueOffset(w) - job.trueOffset(0);
    EXPECT_NEAR(offsetOf(report, job.name(w)), truth, *bound)
        << job.name(w) << ": off by more than the quickest round trip";
  }
}

// Calls between random pairs, both ways, a nested call every few, one-way
// delays from a seeded RNG; some pairs' delays lopsided.
void addRandomCalls(SyntheticJob& job, unsigned seed, int count) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> quick(20, 120);
  std::uniform_real_distribution<double> slow(300, 900);
  std::uniform_real_distribution<double> service(50, 400);
  std::uniform_int_distribution<std::size_t> pick(0, job.workerCount() - 1);
  double t = 100;
  for (int i = 0; i < count; ++i) {
    std::size_t caller = pick(rng);
    std::size_t callee = pick(rng);
    while (callee == caller) {
      callee = pick(rng);
    }
    // Requests into odd workers crawl, replies do not: lopsided delays
    // bias the NTP estimate, which the bounds must absorb.
    double request = callee % 2 == 1 ? slow(rng) : quick(rng);
    double reply = quick(rng);
    if (i % 5 == 4 && job.workerCount() > 2) {
      // The callee calls a third worker from inside its handler.
      std::size_t third = pick(rng);
      while (third == caller || third == callee) {
        third = pick(rng);
      }
      double innerRequest = quick(rng);
      double innerService = service(rng);
      double innerReply = quick(rng);
      double innerTotal = innerRequest + innerService + innerReply;
      double outerService = innerTotal + 200;
      const auto& outer =
          job.call(caller, callee, t, request, outerService, reply);
      CallOptions nested;
      nested.clientTid = 2;
      job.call(
          callee,
          third,
          outer.recv + 100,
          innerRequest,
          innerService,
          innerReply,
          nested);
      t = outer.reply + 500;
    } else {
      const auto& c = job.call(caller, callee, t, request, service(rng), reply);
      t = c.reply + 500;
    }
    if (i % 10 == 0) {
      job.instantAndCounter(caller, t - 100);
    }
  }
}

TEST(TraceMerge, RecoversKnownSkewsOfThreeWorkers) {
  SyntheticJob job;
  job.addWorker("ps0", 0, 0);
  job.addWorker("trainer0", 1, 5e6);
  job.addWorker("trainer1", 2, -3e6);
  addRandomCalls(job, 17, 60);

  MergeReport report = mergeTraces(job.traces());
  EXPECT_TRUE(report.alignment.feasible);
  EXPECT_TRUE(report.violations.empty());
  EXPECT_TRUE(report.warnings.empty());
  EXPECT_EQ(report.callsMatched(), job.calls().size());
  EXPECT_EQ(report.requestsChecked, job.calls().size());
  EXPECT_EQ(report.repliesChecked, job.calls().size());
  EXPECT_EQ(offsetOf(report, "ps0"), 0);
  expectOffsetsWithinRoundTrip(job, report);
  expectEveryMessageOrdered(job, report.merged);
  EXPECT_TRUE(checkFailures(report).empty());
}

TEST(TraceMerge, RecoversKnownSkewsOfFourWorkersRankedOutOfOrder) {
  SyntheticJob job;
  // Given out of rank order: the reference is still rank 0.
  job.addWorker("trainer1", 3, -3e6);
  job.addWorker("ps0", 0, 2e6);
  job.addWorker("trainer0", 1, 5e6);
  job.addWorker("ps1", 2, 1.5e3);
  // Every worker calls rank 0 both ways at least once, with quick links.
  double t = 10;
  for (std::size_t w : {0, 2, 3}) {
    const auto& a = job.call(w, 1, t, 40, 100, 45);
    const auto& b = job.call(1, w, a.reply + 300, 50, 80, 41);
    t = b.reply + 300;
  }
  addRandomCalls(job, 4242, 80);

  MergeReport report = mergeTraces(job.traces());
  ASSERT_EQ(report.traces.front().worker, "ps0");
  EXPECT_TRUE(report.alignment.feasible);
  EXPECT_TRUE(report.violations.empty());
  for (std::size_t w = 0; w < job.workerCount(); ++w) {
    // Reference ps0 is worker 1 of the job.
    auto bound = job.minRoundTrip(1, w);
    if (w == 1) {
      continue;
    }
    double truth = job.trueOffset(w) - job.trueOffset(1);
    EXPECT_NEAR(offsetOf(report, job.name(w)), truth, *bound) << job.name(w);
  }
  expectEveryMessageOrdered(job, report.merged);
}

// The least-delay estimates contradict a hard bound: A-B and B-C have
// quick round trips with lopsided delays (each estimate 445 us off), A-C
// only one-way calls, which pin its offset to +-5 us but give no NTP
// sample. The spanning tree goes A-B-C, so only the relaxation can put
// A-C's messages in order.
TEST(TraceMerge, AdjustsEstimatesIntoTheBoundsOfEveryCall) {
  SyntheticJob job;
  std::size_t a = job.addWorker("a", 0, 0);
  std::size_t b = job.addWorker("b", 1, 5e6);
  std::size_t c = job.addWorker("c", 2, -3e6);
  std::size_t d = job.addWorker("d", 3, 1.2e6);
  job.call(a, b, 100, 900, 50, 10);
  job.call(b, c, 2000, 900, 50, 10);
  CallOptions oneWay;
  oneWay.replySent = false;
  job.call(a, c, 4000, 5, 50, 0, oneWay);
  job.call(c, a, 5000, 5, 50, 0, oneWay);
  job.call(d, a, 6000, 30, 50, 30);

  MergeReport report = mergeTraces(job.traces());
  // The scenario really needs the adjustment.
  const PairClock* ab = nullptr;
  const PairClock* bc = nullptr;
  const PairClock* ac = nullptr;
  for (const auto& pair : report.alignment.pairs) {
    if (pair.a == 0 && pair.b == 1)
      ab = &pair;
    if (pair.a == 1 && pair.b == 2)
      bc = &pair;
    if (pair.a == 0 && pair.b == 2)
      ac = &pair;
  }
  ASSERT_TRUE(ab && bc && ac && ab->estimate && bc->estimate);
  EXPECT_FALSE(ac->estimate);
  EXPECT_GT(*ab->estimate + *bc->estimate, ac->hi + 100);

  EXPECT_TRUE(report.alignment.feasible);
  EXPECT_TRUE(report.violations.empty());
  EXPECT_NEAR(offsetOf(report, "c"), -3e6, 10);
  EXPECT_NEAR(offsetOf(report, "b"), 5e6, 910);
  EXPECT_NEAR(offsetOf(report, "d"), 1.2e6, 60);
  expectEveryMessageOrdered(job, report.merged);
}

// Worker b's file says it received call 2 a second before the caller could
// have sent anything: no offsets satisfy both calls.
TEST(TraceMerge, ReportsWhenNoAlignmentExists) {
  SyntheticJob job;
  job.addWorker("a", 0, 0);
  job.addWorker("b", 1, 5e6);
  job.call(0, 1, 100, 40, 50, 40);
  CallOptions corrupt;
  corrupt.corruptRecvUs = -1e6;
  job.call(0, 1, 1000, 40, 50, 40, corrupt);

  MergeReport report = mergeTraces(job.traces());
  EXPECT_FALSE(report.alignment.feasible);
  ASSERT_EQ(report.alignment.conflicts.size(), 1u);
  EXPECT_NE(report.alignment.conflicts[0].find("a#1"), std::string::npos);
  EXPECT_NE(report.alignment.conflicts[0].find("a#2"), std::string::npos);
  ASSERT_FALSE(report.violations.empty());
  std::string warnings;
  for (const auto& w : report.warnings) {
    warnings += w + "\n";
  }
  EXPECT_NE(warnings.find("no clock offsets"), std::string::npos) << warnings;
  EXPECT_NE(warnings.find("worst: call a#"), std::string::npos) << warnings;
  auto failures = checkFailures(report);
  ASSERT_FALSE(failures.empty());
  EXPECT_NE(failures[0].find("before it was sent"), std::string::npos)
      << failures[0];
  EXPECT_EQ(report.merged["otherData"]["alignment"], "infeasible");
}

// Three one-way calls around a cycle, each fine alone and with each other
// pairwise, that together need the clocks to run in a circle.
TEST(TraceMerge, ReportsACycleOfBoundsThatCannotAllHold) {
  SyntheticJob job;
  job.addWorker("a", 0, 0);
  job.addWorker("b", 1, 0);
  job.addWorker("c", 2, 0);
  CallOptions oneWay;
  oneWay.replySent = false;
  job.call(0, 1, 100, -100, 10, 0, oneWay);
  job.call(1, 2, 1000, -100, 10, 0, oneWay);
  job.call(2, 0, 2000, 150, 10, 0, oneWay);

  MergeReport report = mergeTraces(job.traces());
  EXPECT_TRUE(report.alignment.conflicts.empty());
  EXPECT_FALSE(report.alignment.feasible);
  EXPECT_FALSE(checkFailures(report).empty());
}

const json* findSpan(
    const json& merged,
    const std::string& cat,
    const std::string& key,
    const std::string& value) {
  for (const auto& e : merged["traceEvents"]) {
    if (e.value("cat", "") == cat && e.contains("args") &&
        e["args"].value(key, "") == value) {
      return &e;
    }
  }
  return nullptr;
}

// The flow end sits strictly inside the span, on its thread.
void expectBoundTo(const json& flowEvent, const json* span) {
  ASSERT_NE(span, nullptr);
  EXPECT_EQ(flowEvent["pid"], (*span)["pid"]);
  EXPECT_EQ(flowEvent["tid"], (*span)["tid"]);
  double ts = flowEvent["ts"];
  double start = (*span)["ts"];
  double end = start + (*span)["dur"].get<double>();
  EXPECT_GT(ts, start);
  EXPECT_LT(ts, end);
}

TEST(TraceMerge, WritesFlowArrowsBoundToTheirSpans) {
  SyntheticJob job;
  job.addWorker("ps0", 0, 0);
  job.addWorker("trainer0", 1, 5e6);
  job.addWorker("trainer1", 2, -3e6);
  addRandomCalls(job, 99, 20);
  CallOptions noReply;
  noReply.replySent = false;
  const auto& oneWay = job.call(1, 0, 2e6, 50, 50, 0, noReply);
  std::string grad = job.flow(2, 1, 2.1e6, 60);

  MergeReport report = mergeTraces(job.traces());
  const json& merged = report.merged;
  std::map<std::uint64_t, std::vector<const json*>> byId;
  for (const auto& e : merged["traceEvents"]) {
    std::string ph = e["ph"];
    if (ph == "s" || ph == "f") {
      EXPECT_EQ(e["cat"], kFlowCategory);
      byId[e["id"].get<std::uint64_t>()].push_back(&e);
    }
  }
  std::size_t calls = job.calls().size();
  // Requests for every call, replies for all but the one-way one, 1 flow.
  EXPECT_EQ(byId.size(), calls + (calls - 1) + 1);
  EXPECT_EQ(report.arrows.requests, calls);
  EXPECT_EQ(report.arrows.replies, calls - 1);
  EXPECT_EQ(report.arrows.links, 1u);

  std::set<std::string> requestArrows;
  std::set<std::string> replyArrows;
  for (const auto& [id, ends] : byId) {
    ASSERT_EQ(ends.size(), 2u) << "flow id " << id << " not unique";
    const json& s = *ends[0];
    const json& f = *ends[1];
    ASSERT_EQ(s["ph"], "s");
    ASSERT_EQ(f["ph"], "f");
    EXPECT_FALSE(s.contains("bp"));
    EXPECT_EQ(f["bp"], "e");
    EXPECT_EQ(s["name"], f["name"]);
    EXPECT_LE(s["ts"].get<double>(), f["ts"].get<double>());
    std::string name = s["name"];
    if (name == kLinkFlowName) {
      EXPECT_EQ(s["args"]["flow"], grad);
      expectBoundTo(s, findSpan(merged, "autograd", "flow_out", grad));
      expectBoundTo(f, findSpan(merged, "autograd", "flow_in", grad));
      continue;
    }
    std::string call = s["args"]["call"];
    const json* client = findSpan(merged, "rpc.client", "call", call);
    const json* server = findSpan(merged, "rpc.server", "call", call);
    if (name == kRequestFlowName) {
      requestArrows.insert(call);
      expectBoundTo(s, client);
      expectBoundTo(f, server);
    } else {
      ASSERT_EQ(name, kReplyFlowName);
      replyArrows.insert(call);
      expectBoundTo(s, server);
      expectBoundTo(f, client);
    }
  }
  EXPECT_EQ(requestArrows.size(), calls);
  EXPECT_EQ(replyArrows.size(), calls - 1);
  EXPECT_EQ(replyArrows.count(oneWay.id), 0u);
}

// A request that takes no time, from a client span that opens exactly
// at t_send to a server span already open: the start is nudged into the
// client span, past the end's instant. chrome://tracing drops an arrow
// whose end sorts before its start, so the end must follow.
TEST(TraceMerge, AnArrowNeverEndsBeforeItStarts) {
  SyntheticJob job;
  job.addWorker("a", 0, 0);
  job.addWorker("b", 1, 0);
  const auto& c = job.call(0, 1, 100, 0, 50, 0);
  auto traces = job.traces();
  for (auto& e : traces[0].events) {
    if (e.value("cat", "") == "rpc.client") {
      e["dur"] =
          e["ts"].get<double>() + e["dur"].get<double>() - job.local(0, c.send);
      e["ts"] = job.local(0, c.send);
    }
  }
  for (auto& e : traces[1].events) {
    if (e.value("cat", "") == "rpc.server") {
      e["ts"] = e["ts"].get<double>() - 10;
      e["dur"] = e["dur"].get<double>() + 10;
    }
  }
  // The spans are read again from the edited events.
  std::vector<WorkerTrace> edited;
  for (const auto& t : traces) {
    json doc = {
        {"traceEvents", t.events},
        {"otherData",
         {{"torchrpc_trace", 1}, {"worker", t.worker}, {"rank", t.rank}}}};
    edited.push_back(parseWorkerTrace(doc.dump(), t.file));
  }

  MergeReport report = mergeTraces(std::move(edited));
  ASSERT_TRUE(report.violations.empty());
  std::map<std::uint64_t, double> starts;
  std::size_t ends = 0;
  for (const auto& e : report.merged["traceEvents"]) {
    if (e["ph"] == "s") {
      starts[e["id"]] = e["ts"];
    }
  }
  for (const auto& e : report.merged["traceEvents"]) {
    if (e["ph"] == "f") {
      ++ends;
      EXPECT_GE(e["ts"].get<double>(), starts.at(e["id"])) << e.dump();
    }
  }
  EXPECT_EQ(ends, 2u);
}

TEST(TraceMerge, EachWorkerIsAProcessOnTheReferenceClock) {
  SyntheticJob job;
  job.addWorker("ps0", 0, 0);
  job.addWorker("trainer0", 1, 5e6);
  job.call(1, 0, 100, 40, 50, 40);
  job.call(0, 1, 1000, 40, 50, 40);
  job.instantAndCounter(1, 3000);
  auto traces = job.traces();
  // A writer that put its OS pid in: the merge still makes it rank 1.
  for (auto& e : traces[1].events) {
    e["pid"] = 31337;
  }

  MergeReport report = mergeTraces(std::move(traces));
  for (const auto& e : report.merged["traceEvents"]) {
    EXPECT_NE(e["pid"], 31337) << e.dump();
  }
  std::map<int, std::string> processNames;
  for (const auto& e : report.merged["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") {
      EXPECT_TRUE(processNames
                      .emplace(
                          e["pid"].get<int>(),
                          e["args"]["name"].get<std::string>())
                      .second)
          << "two process names for pid " << e["pid"];
    }
    if (e["ph"] == "i" || e["ph"] == "C") {
      EXPECT_EQ(e["pid"], 1);
      // Shifted by trainer0's offset: true time 3000 on ps0's clock.
      EXPECT_NEAR(e["ts"].get<double>(), job.local(0, 3000), 100);
    }
  }
  EXPECT_EQ(processNames[0], "ps0 (rank 0)");
  EXPECT_EQ(processNames[1], "trainer0 (rank 1)");
  // Input events minus the process names replaced, plus two metadata
  // events per worker and two per arrow.
  std::size_t expected = report.inputEvents - 2 + 4 + 2 * 4;
  EXPECT_EQ(report.merged["traceEvents"].size(), expected);
}

TEST(TraceMerge, WorkerWithNoCallsStaysOnItsClockWithAWarning) {
  SyntheticJob job;
  job.addWorker("ps0", 0, 0);
  job.addWorker("trainer0", 1, 5e6);
  job.addWorker("loner", 2, -3e6);
  job.call(1, 0, 100, 40, 50, 40);
  job.instantAndCounter(2, 100);

  MergeReport report = mergeTraces(job.traces());
  EXPECT_EQ(offsetOf(report, "loner"), 0);
  EXPECT_FALSE(report.alignment.connected[2]);
  ASSERT_EQ(report.warnings.size(), 1u);
  EXPECT_NE(report.warnings[0].find("loner"), std::string::npos);
  EXPECT_NE(report.warnings[0].find("own clock"), std::string::npos);
  EXPECT_EQ(report.merged["otherData"]["workers"]["loner"]["aligned"], false);
}

TEST(TraceMerge, SummaryCountsAndListsOneSidedCallsAndFlows) {
  SyntheticJob job;
  job.addWorker("ps0", 0, 0);
  job.addWorker("trainer0", 1, 5e6);
  job.call(1, 0, 100, 40, 50, 40);
  job.call(0, 1, 1000, 40, 50, 40);
  job.call(1, 0, 2000, 40, 50, 40);
  CallOptions clientOnly;
  clientOnly.writeServerSide = false;
  CallOptions serverOnly;
  serverOnly.writeClientSide = false;
  std::string lost1 = job.call(1, 0, 3000, 40, 50, 40, clientOnly).id;
  std::string lost2 = job.call(1, 0, 4000, 40, 50, 40, clientOnly).id;
  std::string orphan = job.call(0, 1, 5000, 40, 50, 40, serverOnly).id;
  job.flow(0, 1, 6000, 30);
  job.flow(1, 0, 6100, 30);
  std::string outOnly = job.flow(0, 1, 6200, 30, true, false);
  std::string inOnly = job.flow(1, 0, 6300, 30, false, true);

  MergeReport report = mergeTraces(job.traces());
  std::ostringstream summary;
  printSummary(report, summary, 1);
  std::string text = summary.str();
  EXPECT_NE(
      text.find("calls: 3 matched, 2 client side only, 1 server side only"),
      std::string::npos)
      << text;
  EXPECT_NE(
      text.find("client side only: " + lost1 + " ... (1 more)"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("server side only: " + orphan + "\n"), std::string::npos)
      << text;
  EXPECT_NE(
      text.find("flows: 2 matched, 1 flow_out only, 1 flow_in only"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("flow_out only: " + outOnly), std::string::npos) << text;
  EXPECT_NE(text.find("flow_in only: " + inOnly), std::string::npos) << text;
  EXPECT_NE(
      text.find("arrows: 3 requests, 3 replies, 2 flows"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("workers: 2, events: "), std::string::npos) << text;
  EXPECT_NE(text.find("(reference)"), std::string::npos) << text;

  auto failures = checkFailures(report);
  std::string all;
  for (const auto& f : failures) {
    all += f + "\n";
  }
  EXPECT_EQ(failures.size(), 5u) << all;
  EXPECT_NE(
      all.find("call " + lost2 + ": trainer0 got a reply from ps0"),
      std::string::npos)
      << all;
  EXPECT_NE(
      all.find("call " + orphan + ": trainer0 replied to ps0"),
      std::string::npos)
      << all;
  EXPECT_NE(
      all.find("flow " + outOnly + ": flow_out on ps0 has no flow_in"),
      std::string::npos)
      << all;
  EXPECT_NE(
      all.find("flow " + inOnly + ": flow_in on ps0 has no flow_out"),
      std::string::npos)
      << all;
}

TEST(TraceMerge, CheckIgnoresCallsThatNeverGotAReply) {
  SyntheticJob job;
  job.addWorker("ps0", 0, 0);
  job.addWorker("trainer0", 1, 5e6);
  job.call(1, 0, 100, 40, 50, 40);
  // Lost on the way: the caller saw no reply (its span says the call timed
  // out) and the callee no request.
  CallOptions lost;
  lost.writeServerSide = false;
  lost.replyArrives = false;
  job.call(1, 0, 1000, 40, 50, 40, lost);
  // Cancelled: the callee got it but sent no reply.
  CallOptions cancelled;
  cancelled.writeClientSide = false;
  cancelled.replySent = false;
  job.call(1, 0, 2000, 40, 50, 40, cancelled);

  MergeReport report = mergeTraces(job.traces());
  EXPECT_EQ(report.clientOnly().size(), 1u);
  EXPECT_EQ(report.serverOnly().size(), 1u);
  EXPECT_TRUE(checkFailures(report).empty());
}

// A caller span without t_reply must say what the call failed with: with
// neither, the trace lost the reply, whether or not the callee's side is
// there.
TEST(TraceMerge, CheckFailsOnACallerSpanWithNeitherReplyNorError) {
  SyntheticJob job;
  job.addWorker("ps0", 0, 0);
  job.addWorker("trainer0", 1, 5e6);
  job.call(1, 0, 100, 40, 50, 40);
  CallOptions timedOut; // the reply came too late: "timeout"
  timedOut.replyArrives = false;
  job.call(1, 0, 1000, 40, 50, 40, timedOut);
  CallOptions noReply = timedOut;
  noReply.clientError = "";
  std::string answered = job.call(1, 0, 2000, 40, 50, 40, noReply).id;
  noReply.writeServerSide = false;
  std::string lost = job.call(0, 1, 3000, 40, 50, 40, noReply).id;

  MergeReport report = mergeTraces(job.traces());
  ASSERT_EQ(report.traces[1].clientSpans.size(), 3u);
  EXPECT_EQ(report.traces[1].clientSpans[1].error, "timeout");
  auto failures = checkFailures(report);
  EXPECT_EQ(
      failures,
      (std::vector<std::string>{
          "call " + lost +
              ": ps0's call to trainer0 (fn fn0) has neither a reply "
              "(t_reply) nor an error",
          "call " + answered +
              ": trainer0's call to ps0 (fn fn2) has neither a reply "
              "(t_reply) nor an error"}));
}

TEST(TraceMerge, RefusesTwoFilesOfOneWorkerNamingBoth) {
  SyntheticJob job;
  job.addWorker("ps0", 0, 0);
  job.addWorker("ps0", 1, 0);
  try {
    mergeTraces(job.traces());
    FAIL() << "merged two files of worker ps0";
  } catch (const TraceInputError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("duplicate worker \"ps0\""), std::string::npos) << what;
    EXPECT_EQ(what.find("ps0.trace.json"), 0u) << what;
    EXPECT_NE(what.find(": ps0.trace.json is"), std::string::npos) << what;
  }
}

TEST(TraceMerge, RefusesTwoWorkersOfOneRank) {
  SyntheticJob job;
  job.addWorker("ps0", 0, 0);
  job.addWorker("trainer0", 0, 0);
  try {
    mergeTraces(job.traces());
    FAIL() << "merged two workers of rank 0";
  } catch (const TraceInputError& e) {
    EXPECT_NE(std::string(e.what()).find("duplicate rank 0"), std::string::npos)
        << e.what();
  }
}

TEST(TraceMerge, RefusesOneCallsClientSpanInTwoFiles) {
  SyntheticJob one;
  one.addWorker("ps0", 0, 0);
  one.addWorker("trainer0", 1, 0);
  one.call(1, 0, 100, 40, 50, 40);
  auto traces = one.traces();
  // A copy of trainer0's file under another name holds trainer0#1 too.
  auto copy = traces[1];
  copy.worker = "trainer9";
  copy.rank = 9;
  copy.file = "trainer9.trace.json";
  traces.push_back(copy);
  try {
    mergeTraces(traces);
    FAIL() << "accepted call trainer0#1 twice";
  } catch (const TraceInputError& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("trainer0#1"), std::string::npos) << what;
    EXPECT_NE(what.find("trainer0.trace.json"), std::string::npos) << what;
    EXPECT_NE(what.find("trainer9.trace.json"), std::string::npos) << what;
  }
}

} // namespace
} // namespace trace
} // namespace torchrpc
