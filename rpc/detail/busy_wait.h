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
// thread after a task. Between polls they yield the CPU. A yielding thread
// stays runnable, so when another process wants the CPU, each yield hands
// it over for the rest of its time slice, and the event the spinner waits
// for (a reply arriving) wakes no one, since no one sleeps: a round trip
// then takes milliseconds, a scheduler tick or more (bench/RESULTS.md, "A
// busy machine").
//
// So every spinner yields through yieldUnlessContended(), which times the
// yield. On a quiet machine a yield returns within microseconds (at most
// another torchrpc spinner runs meanwhile, and it yields back); now and
// then one takes longer (an interrupt, the hypervisor), a few times a
// second. With a busy process on the same CPU, yields take a time slice,
// milliseconds, hundreds of times a second. So a yield longer than
// kContendedYield that comes within kContendedWindow of the previous one
// means something else wants the CPU: then the whole process stops
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
