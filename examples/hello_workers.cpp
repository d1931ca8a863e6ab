// Workers in separate processes. Each registers a couple of functions;
// worker0 calls them on the others, synchronously, asynchronously and
// through a builtin operator, keeps a value on the last worker through a
// remote reference, differentiates through calls on worker1 and the last
// worker, then every worker shuts down gracefully.
//
// Run it as is: with no launcher's variables in the environment it starts
// three workers itself (setting RANK, WORLD_SIZE, MASTER_ADDR and
// MASTER_PORT as torchrun would). Under a launcher (torchrpc-launch,
// torchrun, mpirun, srun) each process is one worker, two or more of them.

#include <torchrpc/torchrpc.h>

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

namespace {

at::Tensor scale(at::Tensor x, double factor) {
  return x * factor;
}

int runWorker() {
  auto options = torchrpc::Options::fromEnvironment();
  if (options.worldSize < 2) {
    std::cerr << "hello_workers needs at least two workers, got "
              << options.worldSize << std::endl;
    return 1;
  }
  std::string name = "worker" + std::to_string(options.rank);
  std::string last = "worker" + std::to_string(options.worldSize - 1);
  torchrpc::Runtime rt(name, options);
  rt.functions().add("scale", &scale);
  rt.functions().add("greet", [&rt](std::string who) {
    return "hello " + who + ", this is " + rt.self().name;
  });
  // Runs on the owner of an RRef, with the value itself.
  rt.functions().add("accumulate", [](at::Tensor total, at::Tensor delta) {
    total.add_(delta);
  });
  rt.start();

  if (rt.rank() == 0) {
    for (const auto& peer : rt.workers()) {
      if (peer.id == rt.rank()) {
        continue;
      }
      std::cout << rt.rpcSync<std::string>(peer, "greet", name) << std::endl;
    }
    auto y = rt.rpcSync<at::Tensor>("worker1", "scale", at::ones({3}), 2.0);
    auto z = rt.rpcAsync<at::Tensor>(last, "aten::mul.Tensor", y, y).wait();
    std::cout << "scale on worker1: " << y << "\n"
              << "aten::mul on " << last << ": " << z << std::endl;
    // The last worker owns a running total; worker0 only holds a reference.
    torchrpc::RRef<at::Tensor> total =
        rt.remote<at::Tensor>(last, "scale", at::zeros({3}), 1.0);
    for (int i = 1; i <= 3; ++i) {
      total.rpcSync<void>("accumulate", at::full({3}, double(i)));
    }
    std::cout << "a total kept on " << total.ownerName() << ": "
              << total.toHere() << std::endl;
    // Gradients through two calls: d/dw sum(scale(scale(w, 3), 4)) = 12.
    auto w = at::ones({3}).requires_grad_();
    {
      torchrpc::autograd::Context context(rt);
      auto a = rt.rpcSync<at::Tensor>("worker1", "scale", w, 3.0);
      auto b = rt.rpcSync<at::Tensor>(last, "scale", a, 4.0);
      context.backward({b.sum()});
      std::cout << "gradient of w through worker1 and " << last << ": "
                << context.gradients().at(w) << std::endl;
    }
    try {
      rt.rpcSync<at::Tensor>("worker1", "scale", at::ones({3}), "not a number");
    } catch (const torchrpc::RpcError& e) {
      std::cout << "a bad call fails as a value: " << e.what() << std::endl;
    }
  }
  return rt.shutdown() ? 0 : 1;
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

// Starts worldSize copies of this worker and waits (bounded) for them; if
// one fails, stops the others.
int launchLocally(int worldSize) {
  std::string port = std::to_string(freePort());
  std::vector<pid_t> children;
  for (int rank = 0; rank < worldSize; ++rank) {
    std::cout.flush();
    pid_t pid = ::fork();
    if (pid == 0) {
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(worldSize).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", port.c_str(), 1);
      int code = 1;
      try {
        code = runWorker();
      } catch (const std::exception& e) {
        std::cerr << "worker" << rank << ": " << e.what() << std::endl;
      }
      std::cout.flush();
      ::_exit(code);
    }
    children.push_back(pid);
  }
  int failures = 0;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(2);
  size_t running = children.size();
  while (running > 0) {
    int status = 0;
    pid_t done = ::waitpid(-1, &status, WNOHANG);
    if (done > 0) {
      --running;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        ++failures;
        for (pid_t pid : children) {
          ::kill(pid, SIGTERM);
        }
      }
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      std::cerr << "workers did not finish in time; stopping them\n";
      for (pid_t pid : children) {
        ::kill(pid, SIGKILL);
      }
      deadline = std::chrono::steady_clock::time_point::max();
      ++failures;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return failures == 0 ? 0 : 1;
}

} // namespace

int main() {
  if (torchrpc::rpc::LaunchEnvironment::fromEnvironment().launcher ==
      torchrpc::rpc::Launcher::kNone) {
    return launchLocally(3);
  }
  return runWorker();
}
