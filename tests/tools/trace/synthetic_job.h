#pragma once

// Worker trace files of a made-up job whose true clock offsets and message
// delays the test chose, following tools/trace/README.md (version 1).

#include <algorithm>
#include <cstddef>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "worker_trace.h"

namespace torchrpc {
namespace trace {
namespace testing {

using nlohmann::json;

// One call as it really happened, in true time (µs).
struct TrueCall {
  std::string id;
  std::size_t caller = 0;
  std::size_t callee = 0;
  double send = 0;
  double recv = 0;
  double sendReply = 0;
  double reply = 0;
  bool replySent = true;
  bool replyArrived = true;
};

struct CallOptions {
  bool replySent = true;
  bool replyArrives = true;
  bool writeClientSide = true; // false: as if the caller's trace lost it
  bool writeServerSide = true;
  // What the caller writes as args.error when no reply arrived, as the
  // library does; empty: nothing (a writer that lost the reply).
  std::string clientError = "timeout";
  int clientTid = 1; // 2 for a call made from inside a handler
  // Added to the t_recv the callee writes: a corrupt file.
  double corruptRecvUs = 0;
};

class SyntheticJob {
 public:
  // True time of the job's start: clocks far from zero, as steady clocks are.
  static constexpr double kStartUs = 1e9;

  // offsetUs: this worker's clock minus true time.
  std::size_t addWorker(std::string name, long long rank, double offsetUs) {
    workers_.push_back({std::move(name), rank, offsetUs, json::array(), 0});
    auto& w = workers_.back();
    for (int tid : {1, 2, 3}) {
      w.events.push_back(
          {{"ph", "M"},
           {"name", "thread_name"},
           {"pid", rank},
           {"tid", tid},
           {"args", {{"name", "thread " + std::to_string(tid)}}}});
    }
    // A process_name of the worker's own, which the merge replaces.
    w.events.push_back(
        {{"ph", "M"},
         {"name", "process_name"},
         {"pid", rank},
         {"tid", 0},
         {"args", {{"name", "pid " + std::to_string(rank)}}}});
    return workers_.size() - 1;
  }

  double local(std::size_t w, double trueUs) const {
    return kStartUs + trueUs + workers_[w].offsetUs;
  }

  double trueOffset(std::size_t w) const {
    return workers_[w].offsetUs;
  }

  const std::string& name(std::size_t w) const {
    return workers_[w].name;
  }

  // A call sent at true time `at` (µs from the start).
  const TrueCall& call(
      std::size_t caller,
      std::size_t callee,
      double at,
      double requestDelay,
      double serviceTime,
      double replyDelay,
      CallOptions options = {}) {
    TrueCall c;
    c.id = workers_[caller].name + "#" +
        std::to_string(++workers_[caller].lastMessageId);
    c.caller = caller;
    c.callee = callee;
    c.send = at;
    c.recv = at + requestDelay;
    c.sendReply = c.recv + serviceTime;
    c.reply = c.sendReply + replyDelay;
    c.replySent = options.replySent;
    c.replyArrived = options.replySent && options.replyArrives;
    std::string fn = "fn" + std::to_string(calls_.size() % 3);

    if (options.writeClientSide) {
      json args = {
          {"call", c.id},
          {"to", workers_[callee].name},
          {"fn", fn},
          {"t_send", local(caller, c.send)}};
      if (c.replyArrived) {
        args["t_reply"] = local(caller, c.reply);
      } else if (!options.clientError.empty()) {
        args["error"] = options.clientError;
      }
      double end = c.replyArrived ? c.reply + 2 : c.send + 5;
      span(
          caller,
          "rpc.client",
          "call " + fn,
          options.clientTid,
          c.send - 3,
          end,
          args);
    }
    if (options.writeServerSide) {
      json args = {
          {"call", c.id},
          {"from", workers_[caller].name},
          {"fn", fn},
          {"t_recv", local(callee, c.recv) + options.corruptRecvUs}};
      if (c.replySent) {
        args["t_send_reply"] = local(callee, c.sendReply);
      }
      // Starts exactly at t_recv: flow ends must still land inside.
      span(
          callee,
          "rpc.server",
          "serve " + fn,
          2,
          c.recv,
          c.sendReply + 1,
          args);
      double queued = c.recv + serviceTime * 0.2;
      span(callee, "rpc.queue", "queued", 2, c.recv, queued, {{"call", c.id}});
      span(callee, "rpc.handler", fn, 2, queued, c.sendReply, {{"call", c.id}});
    }
    calls_.push_back(c);
    return calls_.back();
  }

  // A causal link: an event on `from` ending at true time `at` whose
  // message starts an event on `to` `delay` later.
  std::string flow(
      std::size_t from,
      std::size_t to,
      double at,
      double delay,
      bool writeOut = true,
      bool writeIn = true) {
    std::string id = "grad-" + std::to_string(++lastFlowId_);
    if (writeOut) {
      span(
          from,
          "autograd",
          "send gradients",
          3,
          at - 10,
          at,
          {{"flow_out", id}});
    }
    if (writeIn) {
      span(
          to,
          "autograd",
          "recv gradients",
          3,
          at + delay,
          at + delay + 15,
          {{"flow_in", id}});
    }
    return id;
  }

  // Events of other phases, passed through and shifted.
  void instantAndCounter(std::size_t w, double at) {
    workers_[w].events.push_back(
        {{"ph", "i"},
         {"name", "tick"},
         {"s", "t"},
         {"pid", workers_[w].rank},
         {"tid", 1},
         {"ts", local(w, at)}});
    workers_[w].events.push_back(
        {{"ph", "C"},
         {"name", "queue depth"},
         {"pid", workers_[w].rank},
         {"tid", 1},
         {"ts", local(w, at)},
         {"args", {{"depth", 3}}}});
  }

  json document(std::size_t w) const {
    return {
        {"traceEvents", workers_[w].events},
        {"displayTimeUnit", "ms"},
        {"otherData",
         {{"torchrpc_trace", 1},
          {"worker", workers_[w].name},
          {"rank", workers_[w].rank},
          {"clock", "steady"}}}};
  }

  std::string fileName(std::size_t w) const {
    return workers_[w].name + ".trace.json";
  }

  std::vector<WorkerTrace> traces() const {
    std::vector<WorkerTrace> out;
    for (std::size_t w = 0; w < workers_.size(); ++w) {
      out.push_back(parseWorkerTrace(document(w).dump(), fileName(w)));
    }
    return out;
  }

  void writeFiles(const std::string& dir) const {
    for (std::size_t w = 0; w < workers_.size(); ++w) {
      std::ofstream(dir + "/" + fileName(w)) << document(w).dump(1);
    }
  }

  // The true round trip (request + reply delay) of the quickest call
  // between a and b, either way: the error bound of their offset.
  std::optional<double> minRoundTrip(std::size_t a, std::size_t b) const {
    std::optional<double> best;
    for (const auto& c : calls_) {
      bool between =
          (c.caller == a && c.callee == b) || (c.caller == b && c.callee == a);
      if (between && c.replyArrived) {
        double rtt = (c.recv - c.send) + (c.reply - c.sendReply);
        best = best ? std::min(*best, rtt) : rtt;
      }
    }
    return best;
  }

  const std::vector<TrueCall>& calls() const {
    return calls_;
  }

  std::size_t workerCount() const {
    return workers_.size();
  }

 private:
  struct Worker {
    std::string name;
    long long rank;
    double offsetUs;
    json events;
    int lastMessageId;
  };

  void span(
      std::size_t w,
      const std::string& cat,
      const std::string& name,
      int tid,
      double trueStart,
      double trueEnd,
      json args) {
    workers_[w].events.push_back(
        {{"ph", "X"},
         {"cat", cat},
         {"name", name},
         {"pid", workers_[w].rank},
         {"tid", tid},
         {"ts", local(w, trueStart)},
         {"dur", trueEnd - trueStart},
         {"args", std::move(args)}});
  }

  std::vector<Worker> workers_;
  std::vector<TrueCall> calls_;
  int lastFlowId_ = 0;
};

} // namespace testing
} // namespace trace
} // namespace torchrpc
