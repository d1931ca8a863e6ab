#include "worker_trace.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <system_error>

namespace torchrpc {
namespace trace {

namespace {

using nlohmann::json;

const char* const kClientCat = "rpc.client";
const char* const kServerCat = "rpc.server";
const char* const kTraceSuffix = ".trace.json";

// Validation of one event, with messages that say which event it was.
class EventReader {
 public:
  EventReader(const std::string& file, std::size_t index, const json& event)
      : file_(file),
        index_(index),
        event_(event) {}

  [[noreturn]] void fail(const std::string& cause) const {
    std::string where = "event #" + std::to_string(index_);
    if (!label_.empty()) {
      where += " (" + label_ + ")";
    }
    throw TraceInputError(file_, where + ": " + cause);
  }

  void setLabel(std::string label) {
    label_ = std::move(label);
  }

  double number(const json& object, const char* key, const char* path) const {
    auto it = object.find(key);
    if (it == object.end()) {
      fail(std::string(path) + " missing");
    }
    if (!it->is_number()) {
      fail(std::string(path) + " is not a number");
    }
    return it->get<double>();
  }

  std::optional<double> optionalNumber(
      const json& object,
      const char* key,
      const char* path) const {
    if (object.find(key) == object.end()) {
      return std::nullopt;
    }
    return number(object, key, path);
  }

  std::string string(const json& object, const char* key, const char* path)
      const {
    auto it = object.find(key);
    if (it == object.end()) {
      fail(std::string(path) + " missing");
    }
    if (!it->is_string() || it->get_ref<const std::string&>().empty()) {
      fail(std::string(path) + " is not a non-empty string");
    }
    return it->get<std::string>();
  }

  std::optional<std::string> optionalString(
      const json& object,
      const char* key,
      const char* path) const {
    if (object.find(key) == object.end()) {
      return std::nullopt;
    }
    return string(object, key, path);
  }

  EventRef ref() const {
    EventRef r;
    r.event = index_;
    r.tid = event_.value("tid", json(0));
    r.ts = number(event_, "ts", "ts");
    auto dur = event_.find("dur");
    r.dur = dur != event_.end() && dur->is_number() ? dur->get<double>() : 0;
    return r;
  }

 private:
  const std::string& file_;
  std::size_t index_;
  const json& event_;
  std::string label_;
};

void readEvent(WorkerTrace& trace, std::size_t index) {
  const json& event = trace.events[index];
  EventReader reader(trace.file, index, event);
  if (!event.is_object()) {
    reader.fail("not a JSON object");
  }
  auto ph = event.find("ph");
  if (ph == event.end() || !ph->is_string() ||
      ph->get_ref<const std::string&>().empty()) {
    reader.fail("ph missing or not a string");
  }
  const std::string& phase = ph->get_ref<const std::string&>();
  auto ts = event.find("ts");
  if (ts != event.end() && !ts->is_number()) {
    reader.fail("ts is not a number");
  }
  if (phase == "X") {
    reader.number(event, "ts", "ts");
    if (reader.number(event, "dur", "dur") < 0) {
      reader.fail("dur is negative");
    }
  } else if (phase == "i" || phase == "I") {
    reader.number(event, "ts", "ts");
  }

  auto argsIt = event.find("args");
  const json* args =
      argsIt != event.end() && argsIt->is_object() ? &*argsIt : nullptr;
  auto cat = event.find("cat");
  bool isClient = cat != event.end() && *cat == kClientCat;
  bool isServer = cat != event.end() && *cat == kServerCat;
  if (isClient || isServer) {
    reader.setLabel(isClient ? kClientCat : kServerCat);
    if (phase != "X") {
      reader.fail("an RPC span must be a complete event (ph \"X\")");
    }
    if (args == nullptr) {
      reader.fail("args missing or not an object");
    }
    std::string call = reader.string(*args, "call", "args.call");
    reader.setLabel(
        std::string(isClient ? kClientCat : kServerCat) + " of call " + call);
    if (isClient) {
      ClientSpan span;
      span.where = reader.ref();
      span.call = std::move(call);
      span.to = reader.string(*args, "to", "args.to");
      span.fn = reader.string(*args, "fn", "args.fn");
      span.tSend = reader.number(*args, "t_send", "args.t_send");
      span.tReply = reader.optionalNumber(*args, "t_reply", "args.t_reply");
      span.error = reader.optionalString(*args, "error", "args.error");
      trace.clientSpans.push_back(std::move(span));
    } else {
      ServerSpan span;
      span.where = reader.ref();
      span.call = std::move(call);
      span.from = reader.string(*args, "from", "args.from");
      span.fn = reader.string(*args, "fn", "args.fn");
      span.tRecv = reader.number(*args, "t_recv", "args.t_recv");
      span.tSendReply =
          reader.optionalNumber(*args, "t_send_reply", "args.t_send_reply");
      trace.serverSpans.push_back(std::move(span));
    }
  }
  if (args != nullptr) {
    for (const char* key : {"flow_out", "flow_in"}) {
      if (args->find(key) == args->end()) {
        continue;
      }
      std::string path = std::string("args.") + key;
      FlowEnd end;
      end.id = reader.string(*args, key, path.c_str());
      if (event.find("ts") == event.end()) {
        reader.fail(path + " on an event without ts");
      }
      end.where = reader.ref();
      bool out = std::string(key) == "flow_out";
      (out ? trace.flowOuts : trace.flowIns).push_back(std::move(end));
    }
  }
}

// A killed worker leaves a file that stops mid-document; say so rather
// than quote the parser.
bool endsEarly(const nlohmann::json::parse_error& e, const std::string& text) {
  // e.byte counts from 1: past the last byte means the input ran out.
  return e.byte > text.size() ||
      std::string(e.what()).find("end of input") != std::string::npos;
}

template <typename Span>
void refuseDuplicates(
    const WorkerTrace& trace,
    const std::vector<Span>& spans,
    const char* what) {
  std::set<std::string> seen;
  for (const auto& span : spans) {
    if (!seen.insert(span.call).second) {
      throw TraceInputError(
          trace.file,
          std::string("two ") + what + " spans for call " + span.call);
    }
  }
}

void refuseDuplicateFlows(
    const WorkerTrace& trace,
    const std::vector<FlowEnd>& ends,
    const char* key) {
  std::set<std::string> seen;
  for (const auto& end : ends) {
    if (!seen.insert(end.id).second) {
      throw TraceInputError(
          trace.file,
          std::string("two events with args.") + key + " \"" + end.id + "\"");
    }
  }
}

} // namespace

WorkerTrace parseWorkerTrace(const std::string& text, const std::string& file) {
  if (text.find_first_not_of(" \t\r\n") == std::string::npos) {
    throw TraceInputError(
        file,
        "empty (the worker stopped before it wrote its trace?)");
  }
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::parse_error& e) {
    if (endsEarly(e, text)) {
      throw TraceInputError(
          file,
          "truncated: the JSON stops after " + std::to_string(text.size()) +
              " bytes, before the document is complete (was the worker "
              "killed while writing it?)");
    }
    throw TraceInputError(
        file,
        "not JSON (byte " + std::to_string(e.byte) + "): " + e.what());
  }
  if (!doc.is_object()) {
    throw TraceInputError(
        file,
        "not a torchrpc worker trace: the top level is not an object with "
        "traceEvents and otherData");
  }
  auto other = doc.find("otherData");
  if (other == doc.end() || !other->is_object() ||
      other->find("torchrpc_trace") == other->end()) {
    throw TraceInputError(
        file,
        "not a torchrpc worker trace: otherData.torchrpc_trace missing");
  }
  const json& version = (*other)["torchrpc_trace"];
  if (!version.is_number_integer()) {
    throw TraceInputError(file, "otherData.torchrpc_trace is not an integer");
  }
  if (version.get<long long>() != kTraceFormatVersion) {
    throw TraceInputError(
        file,
        "trace format version " + version.dump() +
            ", this tool reads version " + std::to_string(kTraceFormatVersion));
  }

  WorkerTrace trace;
  trace.file = file;
  auto worker = other->find("worker");
  if (worker == other->end()) {
    throw TraceInputError(file, "otherData.worker missing");
  }
  if (!worker->is_string() || worker->get_ref<const std::string&>().empty()) {
    throw TraceInputError(file, "otherData.worker is not a non-empty string");
  }
  trace.worker = worker->get<std::string>();
  auto rank = other->find("rank");
  if (rank == other->end()) {
    throw TraceInputError(file, "otherData.rank missing");
  }
  if (!rank->is_number_integer() || rank->get<long long>() < 0) {
    throw TraceInputError(file, "otherData.rank is not a non-negative integer");
  }
  trace.rank = rank->get<long long>();
  auto clock = other->find("clock");
  if (clock != other->end()) {
    if (!clock->is_string()) {
      throw TraceInputError(file, "otherData.clock is not a string");
    }
    trace.clock = clock->get<std::string>();
  }
  auto events = doc.find("traceEvents");
  if (events == doc.end() || !events->is_array()) {
    throw TraceInputError(file, "traceEvents missing or not an array");
  }
  trace.events = std::move(*events);
  for (std::size_t i = 0; i < trace.events.size(); ++i) {
    readEvent(trace, i);
  }
  refuseDuplicates(trace, trace.clientSpans, kClientCat);
  refuseDuplicates(trace, trace.serverSpans, kServerCat);
  refuseDuplicateFlows(trace, trace.flowOuts, "flow_out");
  refuseDuplicateFlows(trace, trace.flowIns, "flow_in");
  return trace;
}

WorkerTrace readWorkerTrace(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw TraceInputError(path, "cannot open");
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    throw TraceInputError(path, "read failed");
  }
  return parseWorkerTrace(text.str(), path);
}

std::vector<std::string> expandInputs(const std::vector<std::string>& inputs) {
  namespace fs = std::filesystem;
  std::vector<std::string> files;
  for (const auto& input : inputs) {
    std::error_code ec;
    auto status = fs::status(input, ec);
    if (ec || !fs::exists(status)) {
      throw TraceInputError(input, "no such file or directory");
    }
    if (!fs::is_directory(status)) {
      files.push_back(input);
      continue;
    }
    std::vector<std::string> found;
    for (const auto& entry : fs::directory_iterator(input, ec)) {
      const std::string name = entry.path().filename().string();
      if (name.size() > std::string(kTraceSuffix).size() &&
          name.compare(
              name.size() - std::string(kTraceSuffix).size(),
              std::string::npos,
              kTraceSuffix) == 0 &&
          !entry.is_directory()) {
        found.push_back(entry.path().string());
      }
    }
    if (ec) {
      throw TraceInputError(input, "cannot list: " + ec.message());
    }
    if (found.empty()) {
      throw TraceInputError(
          input,
          std::string("no *") + kTraceSuffix + " files in directory");
    }
    std::sort(found.begin(), found.end());
    files.insert(files.end(), found.begin(), found.end());
  }
  return files;
}

} // namespace trace
} // namespace torchrpc
