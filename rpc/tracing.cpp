#include "torchrpc/rpc/tracing.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <thread>

#include <unistd.h>

namespace torchrpc {
namespace rpc {

namespace {

thread_local bool threadMarkedFlag = false;

void appendEscaped(std::string& out, const std::string& text) {
  out += '"';
  for (unsigned char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20) {
          char buffer[8];
          std::snprintf(buffer, sizeof(buffer), "\\u%04x", c);
          out += buffer;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void appendNumber(std::string& out, double value) {
  char buffer[48];
  // Microseconds on a steady clock since boot: 3 decimals keep nanoseconds.
  std::snprintf(buffer, sizeof(buffer), "%.3f", value);
  out += buffer;
}

// Microseconds with 3 decimals, from integer nanoseconds: exact, so that a
// child span ending with its parent is written ending at the same time.
void appendMicros(std::string& out, int64_t nanoseconds) {
  if (nanoseconds < 0) {
    out += '-';
    nanoseconds = -nanoseconds;
  }
  char buffer[32];
  std::snprintf(
      buffer,
      sizeof(buffer),
      "%lld.%03lld",
      static_cast<long long>(nanoseconds / 1000),
      static_cast<long long>(nanoseconds % 1000));
  out += buffer;
}

int64_t nanosOf(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             t.time_since_epoch())
      .count();
}

void appendValue(std::string& out, const TraceValue& value) {
  if (const auto* i = std::get_if<int64_t>(&value)) {
    out += std::to_string(*i);
  } else if (const auto* d = std::get_if<double>(&value)) {
    appendNumber(out, *d);
  } else {
    appendEscaped(out, std::get<std::string>(value));
  }
}

void appendArgs(std::string& out, const TraceArgs& args) {
  out += "\"args\":{";
  for (size_t i = 0; i < args.size(); ++i) {
    if (i > 0) {
      out += ',';
    }
    appendEscaped(out, args[i].first);
    out += ':';
    appendValue(out, args[i].second);
  }
  out += '}';
}

// An event's JSON object up to its tid, which Tracer::append() completes:
// `opening` (the phase), then category, name, ts, dur (spans only), args
// and pid.
std::string eventText(
    const char* opening,
    const char* category,
    const std::string& name,
    int64_t startNs,
    const int64_t* durationNs,
    const TraceArgs& args,
    int64_t rank) {
  std::string text;
  text.reserve(160 + name.size());
  text += opening;
  text += "\"cat\":";
  appendEscaped(text, category);
  text += ",\"name\":";
  appendEscaped(text, name);
  text += ",\"ts\":";
  appendMicros(text, startNs);
  if (durationNs != nullptr) {
    text += ",\"dur\":";
    appendMicros(text, *durationNs);
  }
  text += ',';
  appendArgs(text, args);
  text += ",\"pid\":" + std::to_string(rank) + ",\"tid\":";
  return text;
}

} // namespace

Tracer::Tracer(std::string worker, int64_t rank, size_t maxEvents)
    : worker_(std::move(worker)),
      rank_(rank),
      maxEvents_(maxEvents) {}

Tracer::~Tracer() = default;

void Tracer::start() {
  enabled_.store(true, std::memory_order_relaxed);
}

void Tracer::stop() {
  enabled_.store(false, std::memory_order_relaxed);
}

void Tracer::traceSteps(int64_t first, int64_t count) {
  TORCH_CHECK(
      first >= 0 && count > 0 &&
          count <= std::numeric_limits<int64_t>::max() - first,
      "a trace window needs a first step >= 0 and a count > 0 (and their sum "
      "an int64), not ",
      first,
      " and ",
      count);
  windowFirst_ = first;
  windowEnd_ = first + count;
  if (step_.load() == first) {
    start();
  }
}

void Tracer::follow(bool on) {
  followMarks_.store(on, std::memory_order_relaxed);
}

void Tracer::step() {
  int64_t now = step_.fetch_add(1) + 1;
  if (now == windowFirst_.load()) {
    start();
  } else if (now == windowEnd_.load()) {
    stop();
  }
}

Tracer::ThreadMark::ThreadMark(bool marked) : previous_(threadMarkedFlag) {
  threadMarkedFlag = marked;
}

Tracer::ThreadMark::~ThreadMark() {
  threadMarkedFlag = previous_;
}

bool Tracer::threadMarked() noexcept {
  return threadMarkedFlag;
}

int Tracer::threadNumber() {
  // Under mutex_. Few threads ever record: a linear search is enough.
  size_t self = std::hash<std::thread::id>()(std::this_thread::get_id());
  for (const auto& entry : threads_) {
    if (entry.first == self) {
      return entry.second;
    }
  }
  int number = static_cast<int>(threads_.size()) + 1;
  threads_.emplace_back(self, number);
  return number;
}

void Tracer::append(Event event) {
  std::lock_guard<std::mutex> guard(mutex_);
  if (events_.size() >= maxEvents_) {
    ++dropped_;
    return;
  }
  event.thread = threadNumber();
  events_.push_back(std::move(event));
}

void Tracer::complete(
    const char* category,
    std::string name,
    Clock::time_point start,
    Clock::time_point end,
    TraceArgs args) {
  Event event;
  event.span = true;
  event.startNs = nanosOf(start);
  event.endNs = std::max(event.startNs, nanosOf(end));
  const int64_t duration = event.endNs - event.startNs;
  event.json = eventText(
      "{\"ph\":\"X\",",
      category,
      name,
      event.startNs,
      &duration,
      args,
      rank_);
  append(std::move(event));
}

void Tracer::instant(const char* category, std::string name, TraceArgs args) {
  if (!enabled()) {
    return;
  }
  Event event;
  event.startNs = event.endNs = nanosOf(Clock::now());
  event.json = eventText(
      "{\"ph\":\"i\",\"s\":\"t\",",
      category,
      name,
      event.startNs,
      nullptr,
      args,
      rank_);
  append(std::move(event));
}

size_t Tracer::events() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return events_.size();
}

size_t Tracer::dropped() const {
  std::lock_guard<std::mutex> guard(mutex_);
  return dropped_;
}

std::string Tracer::json() const {
  std::lock_guard<std::mutex> guard(mutex_);
  // Note [Tracing], "Threads and lanes": each thread's spans, from the
  // earliest (the longest first among those that start together), go to
  // the first lane where they nest in what is open there. A lane is a stack
  // of the ends of its open spans; the top ends first.
  std::vector<int> tids(events_.size());
  std::map<int, std::vector<size_t>> spansByThread;
  for (size_t i = 0; i < events_.size(); ++i) {
    tids[i] = events_[i].thread;
    if (events_[i].span) {
      spansByThread[events_[i].thread].push_back(i);
    }
  }
  int nextTid = static_cast<int>(threads_.size()) + 1;
  std::vector<std::pair<int, std::string>> laneNames;
  for (auto& [thread, spans] : spansByThread) {
    std::sort(spans.begin(), spans.end(), [this](size_t a, size_t b) {
      const Event& x = events_[a];
      const Event& y = events_[b];
      if (x.startNs != y.startNs) {
        return x.startNs < y.startNs;
      }
      if (x.endNs != y.endNs) {
        return x.endNs > y.endNs;
      }
      return a < b;
    });
    std::vector<std::vector<int64_t>> lanes;
    std::vector<int> laneTids;
    for (size_t i : spans) {
      const Event& event = events_[i];
      size_t lane = 0;
      for (; lane < lanes.size(); ++lane) {
        auto& open = lanes[lane];
        while (!open.empty() && open.back() <= event.startNs) {
          open.pop_back();
        }
        if (open.empty() || open.back() >= event.endNs) {
          break;
        }
      }
      if (lane == lanes.size()) {
        lanes.emplace_back();
        if (lane == 0) {
          laneTids.push_back(thread);
        } else {
          laneTids.push_back(nextTid++);
          laneNames.emplace_back(
              laneTids.back(),
              "thread " + std::to_string(thread) + ", lane " +
                  std::to_string(lane));
        }
      }
      lanes[lane].push_back(event.endNs);
      tids[i] = laneTids[lane];
    }
  }

  std::string out = "{\"traceEvents\":[\n";
  const std::string pid = std::to_string(rank_);
  bool first = true;
  auto separate = [&] {
    if (!first) {
      out += ",\n";
    }
    first = false;
  };
  for (size_t i = 0; i < events_.size(); ++i) {
    separate();
    out += events_[i].json;
    out += std::to_string(tids[i]);
    out += '}';
  }
  for (const auto& [tid, name] : laneNames) {
    separate();
    out += "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" + pid +
        ",\"tid\":" + std::to_string(tid) + ",\"args\":{\"name\":";
    appendEscaped(out, name);
    out += "}}";
  }
  out += "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"torchrpc_trace\":1,";
  out += "\"worker\":";
  appendEscaped(out, worker_);
  out += ",\"rank\":" + pid +
      ",\"clock\":\"steady\",\"dropped_events\":" + std::to_string(dropped_) +
      "}}\n";
  return out;
}

std::string Tracer::write(const std::string& directory) const {
  namespace fs = std::filesystem;
  fs::path dir(directory);
  fs::path path = dir / (worker_ + ".trace.json");
  std::error_code ec;
  fs::create_directories(dir, ec);
  TORCH_CHECK(
      !ec,
      "cannot create the trace directory '",
      directory,
      "': ",
      ec.message());
  fs::path temporary = path;
  temporary += ".tmp" + std::to_string(::getpid());
  std::string document = json();
  {
    std::ofstream file(temporary, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(
        file.good(),
        "cannot write the trace file '",
        temporary.string(),
        "': ",
        std::strerror(errno));
    file.write(document.data(), static_cast<std::streamsize>(document.size()));
    file.close();
    TORCH_CHECK(
        !file.fail(),
        "cannot write the trace file '",
        temporary.string(),
        "': ",
        std::strerror(errno));
  }
  fs::rename(temporary, path, ec);
  TORCH_CHECK(
      !ec,
      "cannot move the trace file into place at '",
      path.string(),
      "': ",
      ec.message());
  return path.string();
}

} // namespace rpc
} // namespace torchrpc
