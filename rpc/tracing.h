#pragma once

// Tracing: each worker records spans of what it does (calls, handlers,
// backward passes, optimizer steps, transport writes) and writes them as a
// Trace Event JSON file that torchrpc-trace-merge joins with the other
// workers' into one timeline (Note [Tracing]).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace torchrpc {
namespace rpc {

// Note [Tracing]
// ~~~~~~~~~~~~~~
// Off, tracing costs one relaxed atomic load at each place that would record
// (Tracer::enabled()); nothing is allocated, formatted or locked. On, a span
// is formatted when it ends and appended to the tracer's buffer under a
// mutex: spans end at most a few times per message, and a lock taken for a
// push_back is far cheaper than the message. The buffer holds at most
// Options::traceMaxEvents events; later ones are counted as dropped (the
// file says how many), so a forgotten trace cannot exhaust memory.
//
// The file follows the per-worker contract of tools/trace/README.md
// (version 1): "X" spans on the worker's steady clock; an RPC's caller span
// (cat "rpc.client") and callee span ("rpc.server") share args.call =
// "<caller>#<message id>" and carry the four times the merge aligns clocks
// with; other causal links (a gradient sent in backward and its receipt)
// are args.flow_out / args.flow_in ids. A request carries a "traced" mark
// when its caller traced it; a callee records the rpc.server span only for
// marked requests (the merge pairs it with the caller's span), and its
// queueing (rpc.queue) and handler (rpc.handler) spans for any it traces.
// The callee records its spans before its reply leaves, so that a caller
// holding the reply finds them.
//
// When: from start() to stop() (Options::traceDirectory starts it with the
// runtime and writes the file at shutdown), or for a window of steps
// (Options::traceSteps): the worker that counts steps (Runtime::step(),
// which DistributedOptimizer::step() calls) traces the steps of the window,
// its requests carry a "traced" mark, and a worker that does not count steps
// itself traces the requests that carry it, and what they cause there
// (nested calls, backward passes, optimizer steps), so the window is one
// step across the whole job.
//
// Threads and lanes: an event's tid is the thread that recorded it. Viewers
// draw one thread's spans as a stack, so they must nest; spans that only
// overlap (an rpc.client span is recorded by whichever thread takes the
// reply, and 64 pipelined calls overlap on it) would be drawn wrongly or
// dropped. json() therefore moves a span that does not nest into the first
// free extra lane of its thread: a tid of its own, named "thread <n>, lane
// <k>" by a thread_name metadata event. Lanes are assigned when the file is
// written, so recording stays a push_back.

// An argument of a span: integer, floating point or text.
using TraceValue = std::variant<int64_t, double, std::string>;
using TraceArgs = std::vector<std::pair<std::string, TraceValue>>;

class Tracer {
 public:
  using Clock = std::chrono::steady_clock;

  // `worker` and `rank` name the file and go into it.
  Tracer(std::string worker, int64_t rank, size_t maxEvents);
  ~Tracer();
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  // The check every recording site makes first. Relaxed: a span that starts
  // just before or after start()/stop() is recorded or not, either is fine.
  bool enabled() const noexcept {
    return enabled_.load(std::memory_order_relaxed) ||
        (followMarks_.load(std::memory_order_relaxed) && threadMarked());
  }

  // Records everything from now on (until stop()).
  void start();
  void stop();
  bool started() const noexcept {
    return enabled_.load(std::memory_order_relaxed);
  }

  // Step windows (Note [Tracing], "When"). traceSteps(first, count): steps
  // [first, first + count) of this worker are traced; steps are counted by
  // step(), from 0. follow(true): trace what marked requests cause here.
  void traceSteps(int64_t first, int64_t count);
  void follow(bool on);
  // Marks the end of a step (and the start of the next).
  void step();
  int64_t currentStep() const noexcept {
    return step_.load(std::memory_order_relaxed);
  }
  // While a ThreadMark(true) is alive on this thread, enabled() holds for a
  // follower: the agent puts one around the handling of a marked request.
  class ThreadMark {
   public:
    explicit ThreadMark(bool marked);
    ~ThreadMark();
    ThreadMark(const ThreadMark&) = delete;
    ThreadMark& operator=(const ThreadMark&) = delete;

   private:
    bool previous_;
  };
  // Whether the calling thread handles a marked request (what the agent
  // puts on the requests it sends from it).
  static bool threadMarked() noexcept;

  // Records a complete span ("X"); category as in the contract ("rpc.client",
  // "autograd", ...). Whoever records decides when the span begins, by
  // enabled() (TraceSpan does): a span that began traced is kept even if
  // tracing stopped meanwhile or it ends on an unmarked thread.
  void complete(
      const char* category,
      std::string name,
      Clock::time_point start,
      Clock::time_point end,
      TraceArgs args = {});
  // Records an instant event ("i"), if enabled().
  void instant(const char* category, std::string name, TraceArgs args = {});

  // Microseconds on the trace's clock (the steady clock's epoch), the unit
  // of ts and of the contract's t_* arguments. (ts and dur are written from
  // integer nanoseconds, so that a span that ends with its parent ends at
  // the same written time.)
  static double micros(Clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t.time_since_epoch())
        .count();
  }

  // Events recorded and dropped over the cap, so far.
  size_t events() const;
  size_t dropped() const;

  // Writes what was recorded so far to `<directory>/<worker>.trace.json`
  // (through a temporary file and a rename, so a reader never sees half a
  // file) and returns the path. The directory is created if missing.
  // Throws c10::Error naming the path and the cause.
  std::string write(const std::string& directory) const;
  // The same document as a string.
  std::string json() const;

 private:
  // One recorded event: its JSON object up to (not including) the tid, and
  // what json() needs to place it in a lane.
  struct Event {
    std::string json;
    int64_t startNs = 0;
    int64_t endNs = 0;
    int thread = 0;
    bool span = false;
  };
  void append(Event event);
  // The small per-thread number that is the events' tid.
  int threadNumber();

  const std::string worker_;
  const int64_t rank_;
  const size_t maxEvents_;
  std::atomic<bool> enabled_{false};
  std::atomic<bool> followMarks_{false};
  std::atomic<int64_t> step_{0};
  std::atomic<int64_t> windowFirst_{-1};
  std::atomic<int64_t> windowEnd_{-1};

  mutable std::mutex mutex_;
  std::vector<Event> events_;
  size_t dropped_ = 0;
  // The thread numbers handed out, by std::thread::id hash.
  std::vector<std::pair<size_t, int>> threads_;
};

// A span of code, recorded when it ends if tracing was enabled when it
// began. Name and arguments are built only then:
//
//   TraceSpan span(tracer, "optim");
//   if (span) { span.name("step " + owner); span.arg("params", n); }
class TraceSpan {
 public:
  TraceSpan(Tracer& tracer, const char* category)
      : tracer_(tracer.enabled() ? &tracer : nullptr),
        category_(category) {
    if (tracer_ != nullptr) {
      start_ = Tracer::Clock::now();
    }
  }
  ~TraceSpan() {
    if (tracer_ != nullptr) {
      tracer_->complete(
          category_,
          std::move(name_),
          start_,
          Tracer::Clock::now(),
          std::move(args_));
    }
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

  explicit operator bool() const noexcept {
    return tracer_ != nullptr;
  }
  void name(std::string name) {
    name_ = std::move(name);
  }
  void arg(std::string key, TraceValue value) {
    args_.emplace_back(std::move(key), std::move(value));
  }

 private:
  Tracer* tracer_;
  const char* category_;
  Tracer::Clock::time_point start_;
  std::string name_;
  TraceArgs args_;
};

} // namespace rpc
} // namespace torchrpc
