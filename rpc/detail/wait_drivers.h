#pragma once

// Threads that wait for a future drive the transport that brings the
// answer. See Note [Waiting callers drive the transport].

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

namespace torchrpc {
namespace rpc {
namespace detail {

// Note [Waiting callers drive the transport]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A caller blocked in Future::wait() spins for a while before it sleeps
// (Note [Adaptive spin]), and meanwhile the TCP transport's io thread polls
// the sockets for the reply (Note [Polling after traffic]): two threads of
// the process spin for one answer, three with the peer's io thread, on a
// machine that may have two CPUs. Instead, the waiting thread runs the
// transport's event loop itself, without blocking (gRPC's completion-queue
// pluck, KJ's event loop): it reads the reply, and the future completes on
// the very thread that needs it. Meanwhile the io thread stands by asleep
// on a condition variable, not in epoll (where it would hold the reactor
// that the waiter needs), and wakes:
//   - at once when a waiter gives up driving before its answer came (it is
//     about to sleep on its future: someone must read the answer); while
//     other waiters still drive, it then checks every 0.2 ms again (below);
//   - when no thread drove for kDriverLinger, 0.2 ms (the next call of a
//     synchronous loop usually comes sooner, so a loop of calls does not
//     wake it each time). It checks for that every 0.2 ms, and during a
//     stretch of waits (a check during which one ended and another went
//     on: a loop of calls, not one long wait) half as often after each
//     check, down to once a millisecond: each check wakes it, and on a
//     machine with few CPUs it often runs on the CPU that a waiter spins
//     on (a loop of round trips took 47-48 µs at the median with a check
//     every 0.2 ms, 39-42 with these; bench/RESULTS.md). Once it has the
//     loop again, or when a send is held for the loop's next turn (Note
//     [Sends held for one write] in tcp/connection.h), it checks every
//     0.2 ms again.
// So at any time either a waiter or the io thread runs the loop, or the io
// thread will within kDriverLinger after a lone wait and within 1 ms after
// a stretch of waits: messages nobody waits for (a peer's requests,
// heartbeats) are read at most that late after a wait ended.
//
// A waiter whose answer has not come when its spin ends (a call that runs
// for milliseconds) would sleep on its future, and the answer would then
// cost two wake-ups: the io thread's, in epoll, to read it, and the
// waiter's, on the future. Instead, one waiter at a time per loop sleeps
// in the loop itself (io_context::run_one_for, so in epoll): the answer
// wakes that thread alone, which reads it and finds its future complete.
// A future completed some other way (another thread, a timeout, a local
// result) wakes it through a callback that posts an empty handler to the
// loop; each sleep is bounded by kBlockingSlice anyway. While it sleeps
// there, it is the loop's thread (the io thread stands by, without
// checks, and is woken when that wait ends, answered or not); other
// waiters sleep on their futures, as the io thread's readers would wake
// them. join() wakes it as it closes the loop to drivers. Only when a
// wait drives exactly one loop: no thread can sleep in two.
//
// A waiter can do neither while the io thread is asleep in the loop, in
// epoll, where it holds the reactor: the waiter's polls find nothing, it
// sleeps on its future, and the io thread reads the answer and wakes it.
// (An answer that comes through a shared ring needs no reactor: the
// waiter's polls look at the rings and post its drain, which the waiter
// runs unless the io thread, woken by that post, gets to it first; Note
// [Rings while the loop polls] in tcp/ring_watch.h.)
// That is the usual case after a quiet spell longer than the io thread's
// polling (Note [Polling after traffic]): the wake-up that the call's own
// send posts to it (noteSend()) is an empty handler, which the waiter's
// first poll can run instead, and the io thread then goes back to epoll.
// Waking the io thread to stand by when a wait begins, with the waiter
// not driving until it has left epoll (at most 0.5 ms), made the answer
// reach the waiter directly in a transport test, but did not make
// bench/compare's dist_autograd_overhead faster (bench/RESULTS.md, "Where
// the distributed-autograd overhead goes").
//
// What a waiter runs is what the io thread would: reads, the handlers of
// cheap functions (Note [Where messages are handled]) and future
// callbacks, one at a time, checking its future in between; a read it
// finishes leaves the next one to the loop (Note [A waiter leaves its
// next read to the loop] in tcp/connection.h). A thread drives only the loops
// registered here (TCP transports with polling on), never from inside a loop it
// is already running (an io thread, or a callback run while driving), and never
// while it runs an inline handler (Future::wait() refuses that wait outright).
// join() closes a transport to drivers and waits for the ones inside before
// it runs the loop's last handlers itself.

// An event loop a waiting thread can run steps of.
class WaitDriver {
 public:
  virtual ~WaitDriver() = default;
  // The calling thread starts driving (always paired with endDriving()).
  virtual void beginDriving() = 0;
  // Runs what is ready without blocking; true if it ran anything. Runs
  // nothing once the loop is closed to drivers.
  virtual bool driveOnce() = 0;
  // The thread stops driving; `answered` is false when it stops before its
  // future completed (it will sleep: the loop's own thread takes over).
  virtual void endDriving(bool answered) = 0;
  // Sleeps in the loop until it ran something or `timeout` passed, unless
  // `done()` holds once this thread is registered as the sleeper (so that
  // a wakeBlockedDriver() racing with the sleep is not lost). False, at
  // once, when this thread may not sleep there: another thread does
  // already, or the loop is closed to drivers or has no work left.
  virtual bool driveBlocking(
      std::chrono::microseconds timeout,
      const std::function<bool()>& done) = 0;
  // Makes the thread sleeping in driveBlocking() return (any thread).
  virtual void wakeBlockedDriver() = 0;
};

// How long a waiter sleeps in a loop before it checks again that its
// future is pending and the loop open (a safety net: it is woken).
constexpr std::chrono::milliseconds kBlockingSlice{50};

// Keeps `driver` registered until destroyed.
class WaitDriverRegistration {
 public:
  explicit WaitDriverRegistration(std::shared_ptr<WaitDriver> driver);
  ~WaitDriverRegistration();
  WaitDriverRegistration(const WaitDriverRegistration&) = delete;
  WaitDriverRegistration& operator=(const WaitDriverRegistration&) = delete;

 private:
  const std::shared_ptr<WaitDriver> driver_;
};

// How a waiting thread drives every registered loop: begins on
// construction (unless this thread already runs a loop), ends on
// destruction or end().
class DrivingScope {
 public:
  DrivingScope();
  ~DrivingScope();
  DrivingScope(const DrivingScope&) = delete;
  DrivingScope& operator=(const DrivingScope&) = delete;

  // One non-blocking step of every loop; true if any ran something.
  bool driveOnce();
  // Sleeps in the loop until `done()`, when this wait drives exactly one
  // loop and no other thread sleeps there; returns at once otherwise, or
  // when the loop closes to drivers. `addWake` is given the function that
  // wakes the sleeper, to call when done() becomes true by other means.
  void blockUntil(
      const std::function<bool()>& done,
      const std::function<void(std::function<void()>)>& addWake);
  void end(bool answered);

 private:
  // The registered drivers when the wait began: a copy-on-write snapshot,
  // so that a wait allocates nothing.
  std::shared_ptr<const std::vector<std::shared_ptr<WaitDriver>>> drivers_;
};

// Marks the current thread as running an event loop for its lifetime: it
// never drives another from a wait (io threads, and drivers themselves).
class EventLoopThreadScope {
 public:
  EventLoopThreadScope();
  ~EventLoopThreadScope();
  EventLoopThreadScope(const EventLoopThreadScope&) = delete;
  EventLoopThreadScope& operator=(const EventLoopThreadScope&) = delete;

 private:
  const bool outer_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
