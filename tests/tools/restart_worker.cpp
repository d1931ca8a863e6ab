// A worker for the restart tests (launch_example_test.sh): in restart
// generation 0 rank 1 fails before it ever starts, while rank 0 already
// waits in start() and so leaves its rendezvous keys in the store. The
// restarted group (TORCHELASTIC_RESTART_COUNT=1) must meet again: under
// torchrun's static rendezvous the store is the agent's and outlives the
// failed group. See Note [Rendezvous keys].

#include <torchrpc/torchrpc.h>

#include <chrono>
#include <iostream>
#include <string>
#include <thread>

int main() {
  auto options = torchrpc::Options::fromEnvironment();
  // A hang must fail the test well within its CTest timeout.
  options.rendezvousTimeout = std::chrono::seconds(30);
  options.shutdownTimeout = std::chrono::seconds(30);
  int64_t restart = options.launch.restartCount;
  if (restart == 0 && options.rank == 1) {
    // Long enough for rank 0 to be inside start().
    std::this_thread::sleep_for(std::chrono::seconds(3));
    std::cout << "rank 1 fails before start in restart 0" << std::endl;
    return 3;
  }
  std::string name = "worker" + std::to_string(options.rank);
  torchrpc::Runtime rt(name, options);
  rt.functions().add("restartCount", [restart]() { return restart; });
  rt.start();
  int64_t peer = (options.rank + 1) % options.worldSize;
  int64_t theirs = rt.rpcSync<int64_t>(peer, "restartCount");
  std::cout << name << " met worker" << peer << " in restart " << restart
            << " (theirs: " << theirs << ")" << std::endl;
  return rt.shutdown() && theirs == restart ? 0 : 1;
}
