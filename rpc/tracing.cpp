#include "torchrpc/rpc/tracing.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
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

void Tracer::append(std::string event) {
  // `event` ends with ",\"tid\":"; the thread number completes it.
  std::lock_guard<std::mutex> guard(mutex_);
  if (events_.size() >= maxEvents_) {
    ++dropped_;
    return;
  }
  event += std::to_string(threadNumber());
  event += '}';
  events_.push_back(std::move(event));
}

void Tracer::complete(
    const char* category,
    std::string name,
    Clock::time_point start,
    Clock::time_point end,
    TraceArgs args) {
  std::string event;
  event.reserve(160 + name.size());
  event += "{\"ph\":\"X\",\"cat\":";
  appendEscaped(event, category);
  event += ",\"name\":";
  appendEscaped(event, name);
  event += ",\"ts\":";
  appendNumber(event, micros(start));
  event += ",\"dur\":";
  appendNumber(
      event,
      std::max(
          0.0,
          std::chrono::duration<double, std::micro>(end - start).count()));
  event += ',';
  appendArgs(event, args);
  event += ",\"pid\":" + std::to_string(rank_) + ",\"tid\":";
  append(std::move(event));
}

void Tracer::instant(const char* category, std::string name, TraceArgs args) {
  if (!enabled()) {
    return;
  }
  std::string event = "{\"ph\":\"i\",\"s\":\"t\",\"cat\":";
  appendEscaped(event, category);
  event += ",\"name\":";
  appendEscaped(event, name);
  event += ",\"ts\":";
  appendNumber(event, micros(Clock::now()));
  event += ',';
  appendArgs(event, args);
  event += ",\"pid\":" + std::to_string(rank_) + ",\"tid\":";
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
  std::string out = "{\"traceEvents\":[\n";
  size_t dropped = 0;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    for (size_t i = 0; i < events_.size(); ++i) {
      out += events_[i];
      out += i + 1 < events_.size() ? ",\n" : "\n";
    }
    dropped = dropped_;
  }
  out += "],\"displayTimeUnit\":\"ms\",\"otherData\":{\"torchrpc_trace\":1,";
  out += "\"worker\":";
  appendEscaped(out, worker_);
  out += ",\"rank\":" + std::to_string(rank_) +
      ",\"clock\":\"steady\",\"dropped_events\":" + std::to_string(dropped) +
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
