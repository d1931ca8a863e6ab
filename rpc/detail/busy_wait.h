#pragma once

// How torchrpc's spinning threads give way on a busy machine. See
// Note [Spinning on a busy machine].

#include <chrono>
#include <cstdint>

namespace torchrpc {
namespace rpc {
namespace detail {

// Note [Spinning on a busy machine]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Three kinds of torchrpc threads spin for a while instead of sleeping, to
// save the cost of a wake-up (Note [Adaptive spin], Note [Polling after
// traffic]): a caller in Future::wait(), an io thread after traffic, a pool
// thread after a task. Between polls they yield the CPU (pollers that ask
// the kernel every few microseconds: Note [Pollers yield every few
// microseconds]). A yielding thread stays runnable, so when another
// process wants the CPU, each yield hands it over for the rest of its time
// slice, and the event the spinner waits for (a reply arriving) wakes no
// one, since no one sleeps: a round trip then takes milliseconds, a
// scheduler tick or more (bench/RESULTS.md, "A busy machine").
//
// So every spinner yields through yieldUnlessContended() (or PollerYields,
// which calls the same), which times the yield. On a quiet machine a yield
// returns within microseconds (at most another torchrpc spinner runs meanwhile,
// and it yields back); now and then one takes longer (an interrupt, the
// hypervisor), a few times a second. With a busy process on the same CPU,
// yields take a time slice, milliseconds, hundreds of times a second. So a
// yield longer than kContendedYield that comes within kContendedWindow of the
// previous one means something else wants the CPU: then the whole process stops
// spinning for kContendedBackoff, and every waiter sleeps in the kernel,
// where the event it waits for wakes it with the scheduler's preference for
// a thread that just woke up. After the back-off, spinners probe again.
// Measured on the 2-vCPU machine, four threads yielding for 3 s: quiet,
// 12 yields over 500 us (in each of two runs) and none over 2 ms; with one
// busy process per core, 2,427 over 2 ms. So the threshold is 2 ms: at
// 500 us, about half of the quiet round-trip runs backed off again and
// again and took 45-53 us instead of 18 (5,500 context switches a run
// instead of 260), while with busy processes 2 ms still backs off (round
// trip 26-34 us, against 8 ms without the back-off; bench/RESULTS.md).
// The state is per process on purpose:
// whether the machine's CPUs are contended is not a property of one
// transport or one runtime.

// A yield longer than this may mean the CPU was wanted by someone else...
constexpr std::chrono::microseconds kContendedYield{2000};
// ... and two of them this close together say it was.
constexpr std::chrono::milliseconds kContendedWindow{20};
// How long the process stops spinning then.
constexpr std::chrono::milliseconds kContendedBackoff{50};
// True while the process holds back from spinning.
bool cpuContended();

// Note [Pollers yield every few microseconds]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A waiter driving the transport and an io thread polling after traffic
// poll with a system call (a zero-timeout epoll_wait) when they hold the
// loop's reactor. Yielding after each poll that found nothing made every
// turn of their loop two system calls, and a message that arrived during
// the yield waited for both to end: with a system call at about a
// microsecond (a guest kernel with page-table isolation), that was on
// each side of a round trip (bench/RESULTS.md, "Pollers yield every few
// microseconds"). So these two yield once per kPollerYieldEvery of polls
// that asked the kernel and found nothing, not after each: a thread of
// another process that wants the CPU waits at most that much longer for
// the first yield, and every yield is still timed, so a contended CPU
// still stops the spinning as in Note [Spinning on a busy machine].
// During a back-off they stop at once, without a yield.
//
// A poll that did not ask the kernel still yields each time: when another
// thread asleep in the loop holds the reactor (DriveStep::kNothing in
// rpc/detail/wait_drivers.h), a poll is a mutex and a few atomics, and
// polling those without a pause would fight the thread that wakes with
// the answer for the loop's mutex. So does the pool's spinner
// (rpc/detail/spinning_thread_pool.h), which checks an atomic.
constexpr std::chrono::microseconds kPollerYieldEvery{5};

// One poller's yields, paced per Note [Pollers yield every few
// microseconds]. Not thread-safe: one per polling loop.
class PollerYields {
 public:
  // A poll found work, or the poller slept: the next empty poll starts a
  // new stretch.
  void newStretch() {
    idleSinceNs_ = kNotIdle;
  }
  // A poll found nothing. False, as yieldUnlessContended(), if the CPU is
  // contended (stop spinning); else true, having yielded once
  // kPollerYieldEvery of empty polls passed since the stretch began or
  // since the last yield.
  bool afterEmptyPoll();
  // How many times this poller yielded (for tests).
  int64_t yields() const {
    return yields_;
  }

 private:
  static constexpr int64_t kNotIdle = -1;
  int64_t idleSinceNs_ = kNotIdle;
  int64_t yields_ = 0;
};

// Yields the CPU once. Returns false, and starts the back-off, if the
// yield showed the CPU contended; false at once during the back-off.
bool yieldUnlessContended();

// How many back-offs this process started (for tests).
int64_t contendedBackoffs();

// For tests of the spinning policies themselves, which would read a busy
// test machine's back-off as their failure: while disabled, long yields
// start no back-off, and disabling ends a back-off under way. On by
// default.
void setContentionBackoffEnabled(bool enabled);

} // namespace detail
} // namespace rpc
} // namespace torchrpc
