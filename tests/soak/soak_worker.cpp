// The soak worker (issue 16): run 4 of them under torchrpc-launch,
//
//   torchrpc-launch --standalone --nproc-per-node 4 --max-restarts 1
//     -- soak_worker --seconds 30
//
// Each worker runs SoakDriver's mix for --seconds. In the first generation
// (restart count 0) worker --kill-rank kills itself with SIGKILL midway;
// the launcher restarts the whole group, which meets again and runs its
// own full soak. At the end of a generation that was not killed, each
// worker checks, printing one "FAIL:" line per problem and exiting 1:
//  - resident memory at the end of the loop grew under 5% over the value
//    after --warmup-seconds;
//  - rank 0: every plain call was answered exactly once (sent == answered
//    == served, per caller and callee, no sequence number twice or missing);
//  - once every worker drained (autograd releases answered), its autograd
//    counters are zero; once every worker dropped what it held, its RRef
//    tables empty and its agent awaits no reply (within a bound); after the
//    graceful shutdown every RRef counter it had at close is zero.
// Progress lines every --progress-seconds.

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/soak/resident_memory.h"
#include "tests/soak/soak_driver.h"
#include "tests/soak/soak_functions.h"
#include "torchrpc/torchrpc.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;
using torchrpc::soak::boundedMemoryKiB;
using torchrpc::soak::boundedMemoryName;
using torchrpc::soak::heapInUseKiB;
using torchrpc::soak::residentKiB;

struct Flags {
  double seconds = 30;
  double warmupSeconds = -1; // default: a third of --seconds
  double progressSeconds = 5;
  int64_t killRank = 2;
  double killAtSeconds = -1; // default: half of --seconds
  // Bound on the growth of RSS after warm-up (of the heap in use under ASan:
  // resident_memory.h).
  double maxRssGrowth = 0.05;
};

[[noreturn]] void usage(const std::string& why) {
  std::cerr << "soak_worker: " << why << "\n"
            << "usage: soak_worker [--seconds S] [--warmup-seconds S] "
               "[--progress-seconds S] [--kill-rank R] [--kill-at-seconds S] "
               "[--max-rss-growth F]\n";
  std::exit(2);
}

Flags parseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    std::string name = argv[i];
    if (i + 1 >= argc) {
      usage(name + " needs a value");
    }
    std::string value = argv[++i];
    try {
      if (name == "--seconds") {
        flags.seconds = std::stod(value);
      } else if (name == "--warmup-seconds") {
        flags.warmupSeconds = std::stod(value);
      } else if (name == "--progress-seconds") {
        flags.progressSeconds = std::stod(value);
      } else if (name == "--kill-rank") {
        flags.killRank = std::stoll(value);
      } else if (name == "--kill-at-seconds") {
        flags.killAtSeconds = std::stod(value);
      } else if (name == "--max-rss-growth") {
        flags.maxRssGrowth = std::stod(value);
      } else {
        usage("unknown flag " + name);
      }
    } catch (const std::logic_error&) {
      usage("bad value for " + name + ": " + value);
    }
  }
  if (flags.warmupSeconds < 0) {
    flags.warmupSeconds = flags.seconds / 3;
  }
  if (flags.killAtSeconds < 0) {
    flags.killAtSeconds = flags.seconds / 2;
  }
  return flags;
}

Clock::duration secondsOf(double s) {
  return std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(s));
}

std::string mib(int64_t kib) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1) << kib / 1024.0 << " MiB";
  return out.str();
}

// Every worker arrives at rank 0's barrier `phase` and waits there until all
// have; false after `timeout`.
bool barrier(torchrpc::Runtime& rt, int64_t phase, Clock::duration timeout) {
  int64_t world = static_cast<int64_t>(rt.workers().size());
  rt.rpcSync<void>(0, "soak.arrive", phase);
  auto until = Clock::now() + timeout;
  while (rt.rpcSync<int64_t>(0, "soak.arrived", phase) < world) {
    if (Clock::now() > until) {
      return false;
    }
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

// The RRef counters and the agent's pending calls, for messages.
std::string describeTables(torchrpc::Runtime& rt) {
  auto c = rt.rrefs().counters();
  std::ostringstream out;
  out << "ownerRRefs " << c.ownerRRefs << ", userRRefs " << c.userRRefs
      << ", pendingForks " << c.pendingForks << ", pendingConfirmations "
      << c.pendingConfirmations << ", tombstones " << c.tombstones
      << ", pending calls " << rt.agent().counters().pendingCalls;
  return out.str();
}

// Waits until every RRef table of this worker is empty and it awaits no
// reply (deletions and their acknowledgements still in flight settle);
// false if that takes longer than `timeout`.
bool settles(torchrpc::Runtime& rt, Clock::duration timeout) {
  auto until = Clock::now() + timeout;
  for (;;) {
    auto c = rt.rrefs().counters();
    if (c.ownerRRefs == 0 && c.userRRefs == 0 && c.pendingForks == 0 &&
        c.pendingConfirmations == 0 && c.tombstones == 0 &&
        rt.agent().counters().pendingCalls == 0) {
      return true;
    }
    if (Clock::now() > until) {
      return false;
    }
    std::this_thread::sleep_for(20ms);
  }
}

} // namespace

int main(int argc, char** argv) {
  Flags flags = parseFlags(argc, argv);
  auto options = torchrpc::Options::fromEnvironment();
  // Generous bounds for a loaded 2-core machine; a hang still ends well
  // within the test's timeout.
  options.rendezvousTimeout = 120s;
  options.shutdownTimeout = 120s;
  const int64_t generation = options.launch.restartCount;
  const int64_t rank = options.rank;
  const std::string name = "worker" + std::to_string(rank);
  const std::string tag = name + " generation " + std::to_string(generation);

  torchrpc::Runtime rt(name, options);
  torchrpc::soak::SoakState state(options.worldSize);
  torchrpc::soak::addSoakFunctions(rt, state);
  rt.start();
  std::cout << tag << ": met " << options.worldSize << " workers" << std::endl;

  const auto start = Clock::now();
  const bool killMe = generation == 0 && rank == flags.killRank;
  const auto killAt = start + secondsOf(flags.killAtSeconds);
  const auto warmupAt = start + secondsOf(flags.warmupSeconds);
  int64_t warmupMemory = -1;
  auto nextProgress = start + secondsOf(flags.progressSeconds);

  torchrpc::soak::SoakDriver driver(
      rt,
      state,
      static_cast<uint32_t>(1000 * generation + rank));
  auto progress = [&](const char* what) {
    const auto& c = driver.counts();
    std::chrono::duration<double> elapsed = Clock::now() - start;
    std::cout << tag << ": " << what << " t=" << std::fixed
              << std::setprecision(1) << elapsed.count()
              << "s ops=" << c.total() << " (calls " << c.calls << ", rrefs "
              << c.rrefsCreated << ", reads " << c.rrefReads << ", forks "
              << c.forks << ", drops " << c.drops << ", steps " << c.trainSteps
              << "; served " << state.ledger.totalServed()
              << ") rss=" << mib(residentKiB())
              << " heap=" << mib(heapInUseKiB()) << std::endl;
  };
  auto tick = [&]() {
    auto now = Clock::now();
    if (killMe && now >= killAt) {
      progress("killing myself (SIGKILL) midway");
      ::kill(::getpid(), SIGKILL);
    }
    if (warmupMemory < 0 && now >= warmupAt) {
      warmupMemory = boundedMemoryKiB();
      std::cout << tag << ": " << boundedMemoryName() << " after warm-up "
                << mib(warmupMemory) << std::endl;
    }
    if (now >= nextProgress) {
      progress("progress");
      nextProgress = now + secondsOf(flags.progressSeconds);
    }
  };

  try {
    driver.run(start + secondsOf(flags.seconds), tick);
  } catch (const std::exception& e) {
    if (generation == 0) {
      // A peer was killed: errors are expected now, and the launcher stops
      // this worker once it sees the dead one.
      std::cout << tag << ": " << e.what()
                << " (expected: a worker was killed); waiting to be stopped"
                << std::endl;
      std::this_thread::sleep_for(120s);
      return 3;
    }
    std::cout << tag << ": FAIL: " << e.what() << std::endl;
    return 1;
  }
  if (generation == 0) {
    // Only reached if the killed worker's loop ended first (a run shorter
    // than --kill-at-seconds): nothing to check in a generation that dies.
    std::cout << tag << ": FAIL: the loop ended before worker" << flags.killRank
              << " was killed" << std::endl;
    return 1;
  }
  const int64_t endMemory = boundedMemoryKiB();
  progress("loop done");

  std::vector<std::string> problems;
  try {
    problems = driver.drain(120s);
  } catch (const std::exception& e) {
    problems.push_back(std::string("draining: ") + e.what());
  }
  if (warmupMemory <= 0 || endMemory <= 0) {
    problems.push_back(
        std::string("no ") + boundedMemoryName() +
        " after warm-up (run longer than the warm-up)");
  } else {
    double growth = double(endMemory - warmupMemory) / double(warmupMemory);
    std::ostringstream line;
    line << boundedMemoryName() << " after warm-up " << mib(warmupMemory)
         << ", at the end " << mib(endMemory) << ", growth "
         << std::setprecision(2) << std::fixed << 100 * growth << "%";
    std::cout << tag << ": " << line.str() << std::endl;
    if (growth >= flags.maxRssGrowth) {
      line << " (bound " << 100 * flags.maxRssGrowth << "%)";
      problems.push_back(line.str());
    }
  }

  // Everyone has drained: no call of the soak is in flight anywhere, and
  // every autograd context is released everywhere.
  if (!barrier(rt, 0, 180s)) {
    problems.push_back("not every worker reached the end-of-loop barrier");
  }
  auto contexts = rt.autogradContexts().counters();
  if (contexts.liveContexts || contexts.sendFunctions ||
      contexts.recvFunctions || contexts.livePasses) {
    std::ostringstream line;
    line << "autograd counters not zero: liveContexts " << contexts.liveContexts
         << ", sendFunctions " << contexts.sendFunctions << ", recvFunctions "
         << contexts.recvFunctions << ", livePasses " << contexts.livePasses;
    problems.push_back(line.str());
  }
  // Then every worker drops the forks others handed it; once all have,
  // the deletions settle and every table empties (before shutdown, which
  // would give everything back anyway).
  state.dropKept();
  if (!barrier(rt, 1, 180s)) {
    problems.push_back("not every worker reached the drop barrier");
  }
  if (!settles(rt, 60s)) {
    problems.push_back(
        "still not settled after 60 s: " + describeTables(rt) +
        " (should all be zero)");
  }
  if (rank == 0) {
    std::vector<std::vector<int64_t>> reports;
    for (const auto& worker : rt.workers()) {
      reports.push_back(
          worker.id == 0
              ? state.ledger.report()
              : rt.rpcSync<std::vector<int64_t>>(worker.id, "soak.report"));
    }
    auto calls = torchrpc::soak::CallLedger::crossCheck(reports);
    problems.insert(problems.end(), calls.begin(), calls.end());
    int64_t total = 0;
    for (size_t r = 0; r < reports.size(); ++r) {
      for (size_t p = 0; p < reports.size(); ++p) {
        total += reports[r][p * 5];
      }
    }
    std::cout << tag << ": " << total << " plain calls across "
              << reports.size() << " workers, "
              << (calls.empty() ? "each answered exactly once" : "MISMATCHES")
              << std::endl;
  }

  if (!rt.shutdown()) {
    problems.push_back("graceful shutdown did not complete");
  }
  auto left = rt.rrefs().leftAtClose();
  if (left.ownerRRefs || left.userRRefs || left.pendingForks ||
      left.pendingConfirmations || left.tombstones) {
    std::ostringstream line;
    line << "RRef tables at close not empty: ownerRRefs " << left.ownerRRefs
         << ", userRRefs " << left.userRRefs << ", pendingForks "
         << left.pendingForks << ", pendingConfirmations "
         << left.pendingConfirmations << ", tombstones " << left.tombstones;
    problems.push_back(line.str());
  }

  for (const auto& problem : problems) {
    std::cout << tag << ": FAIL: " << problem << std::endl;
  }
  if (!problems.empty()) {
    return 1;
  }
  std::cout << tag << ": soak passed" << std::endl;
  return 0;
}
