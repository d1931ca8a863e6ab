#include "local_launch.h"

#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

namespace ps {
namespace {

std::vector<pid_t>* children = nullptr;

void forwardSignal(int signal) {
  if (children != nullptr) {
    for (pid_t pid : *children) {
      ::kill(pid, signal);
    }
  }
}

int freePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

} // namespace

int launchLocally(int worldSize, const std::function<int()>& worker) {
  static std::vector<pid_t> pids;
  std::string port = std::to_string(freePort());
  pid_t parent = ::getpid();
  for (int rank = 0; rank < worldSize; ++rank) {
    std::cout.flush();
    std::cerr.flush();
    pid_t pid = ::fork();
    if (pid == 0) {
      // Never outlive the launcher, however it ends.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) {
        ::_exit(1);
      }
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(worldSize).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", port.c_str(), 1);
      int code = 1;
      try {
        code = worker();
      } catch (const c10::Error& e) {
        std::cerr << "worker" << rank << ": " << e.what_without_backtrace()
                  << std::endl;
      } catch (const std::exception& e) {
        std::cerr << "worker" << rank << ": " << e.what() << std::endl;
      }
      std::cout.flush();
      std::cerr.flush();
      ::_exit(code);
    }
    if (pid < 0) {
      std::cerr << "cannot start worker" << rank << std::endl;
      forwardSignal(SIGTERM);
      break;
    }
    pids.push_back(pid);
  }
  children = &pids;
  ::signal(SIGINT, forwardSignal);
  ::signal(SIGTERM, forwardSignal);

  int failures = int(worldSize - pids.size());
  size_t running = pids.size();
  while (running > 0) {
    int status = 0;
    pid_t done = ::waitpid(-1, &status, 0);
    if (done < 0) {
      if (errno == EINTR) {
        continue;
      }
      break;
    }
    --running;
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      int rank = 0;
      for (size_t i = 0; i < pids.size(); ++i) {
        rank = pids[i] == done ? int(i) : rank;
      }
      std::cerr << "worker" << rank << " "
                << (WIFEXITED(status)
                        ? "exited with " + std::to_string(WEXITSTATUS(status))
                        : "killed by signal " +
                            std::to_string(WTERMSIG(status)))
                << "; stopping the others" << std::endl;
      ++failures;
      forwardSignal(SIGTERM);
    }
  }
  return failures == 0 ? 0 : 1;
}

} // namespace ps
