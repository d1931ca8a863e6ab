// Two workers in one process, over the in-process transport, using only the
// installed headers and libraries. Exit code 0 means the call came back right.
#include <torchrpc/torchrpc.h>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <thread>

int main() {
  auto network = std::make_shared<torchrpc::rpc::InProcessNetwork>();
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto makeOptions = [&](int rank) {
    torchrpc::Options o;
    o.rank = rank;
    o.worldSize = 2;
    o.store = store;
    o.inProcessNetwork = network;
    return o;
  };
  torchrpc::Runtime a("a", makeOptions(0)), b("b", makeOptions(1));
  b.functions().add("twice", [](at::Tensor x) { return x * 2; });
  std::thread t([&] { b.start(); });
  a.start();
  t.join();
  auto y = a.rpcSync<at::Tensor>("b", "twice", at::ones({2}));
  bool ok = y.equal(at::full({2}, 2.0));
  std::thread s([&] { b.shutdown(); });
  a.shutdown();
  s.join();
  return ok ? 0 : 1;
}
