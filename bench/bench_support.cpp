#include "bench/bench_support.h"

#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

namespace torchrpc {
namespace bench {

namespace {

// Name -> metric, unit, better of every workload; bench/pytorch_bench.py's
// WORKLOADS says the same for the PyTorch side.
const std::vector<std::pair<std::string, Metric>>& workloads() {
  static const std::vector<std::pair<std::string, Metric>> kWorkloads = {
      {"call_rtt_1elem", {"median_rtt", "us", "lower"}},
      {"calls_per_s_64_outstanding", {"throughput", "calls/s", "higher"}},
      {"bandwidth_4MiB", {"bandwidth", "GB/s", "higher"}},
      {"bandwidth_64MiB", {"bandwidth", "GB/s", "higher"}},
      {"idle_cpu_cores", {"idle_cpu", "cores", "lower"}},
      {"remote_to_here_rtt", {"median_rtt", "us", "lower"}},
      {"rref_create_delete_per_s", {"rate", "rrefs/s", "higher"}},
      {"dist_autograd_overhead", {"overhead_per_iter", "us", "lower"}},
      {"dist_optimizer_step", {"median_step", "us", "lower"}},
      {"ps_steps_per_s_vs_local", {"steps_per_s_ratio", "ratio", "higher"}},
  };
  return kWorkloads;
}

std::string jsonString(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char escaped[8];
      std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
      out += escaped;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// A forked child's life: runs body and exits with what it returns, 1 if it
// throws; it never unwinds into the parent's code.
[[noreturn]] void runChild(const std::function<int()>& body) {
  int code = 1;
  try {
    code = body();
  } catch (...) {
  }
  std::fflush(nullptr);
  ::_exit(code);
}

} // namespace

[[noreturn]] void usage(const Program& program, const std::string& why) {
  std::cerr << program.name << ": " << why << "\nusage: " << program.name
            << " --workload NAME " << program.options << "\n";
  std::exit(2);
}

bool parseQuickOnly(const std::string& name, int argc, char** argv) {
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string(argv[i]) == "--quick") {
      quick = true;
    } else {
      std::cerr << "usage: " << name << " [--quick]\n";
      std::exit(2);
    }
  }
  return quick;
}

Settings parseCommandLine(const Program& program, int argc, char** argv) {
  Settings s;
  s.transport = program.defaultTransport;
  bool takesTransport = !program.defaultTransport.empty();
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--workload" && i + 1 < argc) {
      s.workload = argv[++i];
    } else if (takesTransport && arg == "--transport" && i + 1 < argc) {
      s.transport = argv[++i];
    } else if (arg == "--quick") {
      s.quick = true;
    } else {
      usage(program, "unknown argument '" + arg + "'");
    }
  }
  if (s.workload.empty()) {
    usage(program, "--workload is required");
  }
  auto known =
      std::find_if(workloads().begin(), workloads().end(), [&s](const auto& w) {
        return w.first == s.workload;
      });
  if (known == workloads().end()) {
    usage(program, "unknown workload '" + s.workload + "'");
  }
  s.metric = known->second;
  return s;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  size_t n = values.size();
  return n % 2 ? values[n / 2] : (values[n / 2 - 1] + values[n / 2]) / 2;
}

double microsSince(Clock::time_point start) {
  return std::chrono::duration<double, std::micro>(Clock::now() - start)
      .count();
}

void printDistribution(const std::string& what, std::vector<double> times) {
  std::sort(times.begin(), times.end());
  auto percentile = [&times](double q) {
    return times[std::min(times.size() - 1, size_t(q * times.size()))];
  };
  std::cerr << what << ": n=" << times.size() << " min=" << times.front()
            << " p10=" << percentile(0.1) << " median=" << median(times)
            << " p90=" << percentile(0.9) << " p99=" << percentile(0.99)
            << " max=" << times.back() << " (us)\n";
}

void printResultLine(
    const Settings& s,
    std::optional<double> value,
    const std::vector<std::pair<std::string, std::string>>& extra,
    const std::string& error) {
  char number[32] = "null";
  if (value) {
    std::snprintf(number, sizeof(number), "%.6g", *value);
  }
  std::string line = "{\"workload\": " + jsonString(s.workload) +
      ", \"metric\": " + jsonString(s.metric.name) +
      ", \"unit\": " + jsonString(s.metric.unit) + ", \"value\": " + number +
      ", \"better\": " + jsonString(s.metric.better);
  for (const auto& [key, text] : extra) {
    line += ", " + jsonString(key) + ": " + jsonString(text);
  }
  if (!error.empty()) {
    line += ", \"error\": " + jsonString(error);
  }
  line += "}\n";
  std::fputs(line.c_str(), stdout);
  std::fflush(stdout);
}

int resultTimeoutMs(const Settings& s) {
  return s.quick ? 90000 : 240000;
}

double cpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), {});
  // The name, in parentheses, may hold spaces and parentheses itself.
  auto close = text.rfind(')');
  std::istringstream fields(text.substr(close + 2));
  std::string field;
  double ticks = 0;
  // Fields after the name start at 3 (state); utime and stime are 14, 15.
  for (int index = 3; index <= 15 && fields >> field; ++index) {
    if (index == 14 || index == 15) {
      ticks += std::stod(field);
    }
  }
  return ticks / sysconf(_SC_CLK_TCK);
}

IdleCpu measureIdleCpu(const std::vector<pid_t>& pids, bool quick) {
  auto used = [&pids]() {
    double total = 0;
    for (pid_t pid : pids) {
      total += cpuSeconds(pid);
    }
    return total;
  };
  double seconds = quick ? 2.0 : 5.0;
  double before = used();
  auto start = Clock::now();
  ::usleep(static_cast<useconds_t>(seconds * 1e6));
  double cpu = used() - before;
  return {
      cpu,
      cpu / std::chrono::duration<double>(Clock::now() - start).count()};
}

void writeAll(int fd, const void* data, size_t size) {
  auto* bytes = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, bytes, size);
    if (n <= 0) {
      return;
    }
    bytes += n;
    size -= static_cast<size_t>(n);
  }
}

std::string readWithin(int fd, size_t capacity, int timeoutMs) {
  pollfd pfd{fd, POLLIN, 0};
  if (::poll(&pfd, 1, timeoutMs) != 1) {
    return {};
  }
  std::string buffer(capacity, '\0');
  ssize_t n = ::read(fd, buffer.data(), capacity);
  buffer.resize(n > 0 ? static_cast<size_t>(n) : 0);
  return buffer;
}

bool readExactlyWithin(int fd, void* data, size_t size, int timeoutMs) {
  std::string bytes = readWithin(fd, size, timeoutMs);
  if (bytes.size() != size) {
    return false;
  }
  std::memcpy(data, bytes.data(), size);
  return true;
}

WorkerProcesses::~WorkerProcesses() {
  for (pid_t pid : pids_) {
    if (pid > 0) { // not reaped yet, so the pid is still ours
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
}

pid_t forkTiedChild(const std::function<int()>& body) {
  const pid_t parent = ::getpid();
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    // Never outlive the parent, however it ends; it may have ended before
    // the line above took effect.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) {
      ::_exit(1);
    }
    runChild(body);
  }
  return pid;
}

pid_t WorkerProcesses::fork(const std::function<int()>& body) {
  std::fflush(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    runChild(body);
  }
  if (pid > 0) {
    pids_.push_back(pid); // never -1: kill(-1) would hit every process
  }
  return pid;
}

void WorkerProcesses::awaitExit(int timeoutMs) {
  auto end = Clock::now() + std::chrono::milliseconds(timeoutMs);
  for (pid_t& pid : pids_) {
    while (pid > 0 && Clock::now() < end) {
      if (::waitpid(pid, nullptr, WNOHANG) != 0) {
        // Reaped (or gone): the number may now belong to another process.
        pid = 0;
      } else {
        ::usleep(10000);
      }
    }
  }
}

} // namespace bench
} // namespace torchrpc
