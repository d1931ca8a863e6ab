// DDP + RPC: a hybrid of data parallelism and a parameter server, as in
// PyTorch's "Combining Distributed DataParallel with Distributed RPC
// Framework" tutorial, in C++.
//
//   rank 0          the parameter server: a large embedding table (10000x16
//                   by default) behind a torchrpc RemoteModule
//   ranks 1..N      trainers: each holds a replica of a small dense part
//                   (Linear 16->1), kept identical with libtorch's own c10d
//                   (a ProcessGroupGloo among the trainers only)
//
// Each step, in a distributed autograd context: the embedding lookup runs on
// the server, the dense part here; context.backward() fills the context with
// the dense part's gradients here and the embedding's on the server. The
// dense gradients are averaged over the trainers with Gloo's allreduce and
// applied by a local SGD; a DistributedOptimizer steps the embedding where it
// lives. At the end the trainers compare their dense replicas bit for bit.
//
// Run as is, it starts every worker itself (the parameter-server example's
// local mode); under a launcher (torchrun, torchrpc-launch, mpirun, srun) each
// process is the worker RANK names.

#include <torchrpc/torchrpc.h>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <optional>
#include <thread>
#include <unistd.h>

#include "local_launch.h"

namespace {

struct Config {
  int trainers = 2;
  int64_t steps = 200;
  int64_t batchSize = 32;
  int64_t bagSize = 8;
  int64_t numEmbeddings = 10000;
  int64_t embeddingDim = 16;
  double denseLr = 0.05;
  double embeddingLr = 1.0;
  int64_t printEvery = 20;
  int64_t seed = 1;
};

// Where the trainers' process group meets in local mode (a store of its own,
// not the RPC one's): a file made before the workers are started.
constexpr const char* kStoreFileVariable = "DDP_RPC_STORE_FILE";

// The embedding table: one bag (the mean of `bagSize` rows) per example.
struct EmbeddingTableImpl : torch::nn::Module {
  EmbeddingTableImpl(int64_t num, int64_t dim, int64_t seed) {
    torch::manual_seed(seed);
    bag = register_module(
        "bag",
        torch::nn::EmbeddingBag(
            torch::nn::EmbeddingBagOptions(num, dim).mode(torch::kMean)));
  }
  // indices: [batch, bagSize] -> [batch, dim]
  at::Tensor forward(at::Tensor indices) {
    return bag->forward(indices);
  }
  torch::nn::EmbeddingBag bag{nullptr};
};
using EmbeddingTable = EmbeddingTableImpl;
using RemoteTable = torchrpc::nn::RemoteModule<EmbeddingTable>;
constexpr const char* kTableType = "ddp_rpc.EmbeddingTable";

void registerTable(torchrpc::rpc::Runtime& rt) {
  torchrpc::nn::registerModuleFactory<EmbeddingTable>(
      rt,
      kTableType,
      [](int64_t num, int64_t dim, int64_t seed) {
        return std::make_shared<EmbeddingTable>(num, dim, seed);
      });
}

// Synthetic regression data, a function of (step, trainer) only: bags of
// indices drawn with a skew towards small ones (as real ids are), and as
// target the mean over the bag of a fixed value per index.
std::pair<at::Tensor, at::Tensor> batch(
    const Config& config,
    int64_t step,
    int trainer) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(
      uint64_t(config.seed) * 1000003u + uint64_t(step) * 131u +
      uint64_t(trainer));
  at::Tensor u = at::rand({config.batchSize, config.bagSize}, gen);
  at::Tensor indices = (u.pow(3) * double(config.numEmbeddings))
                           .to(at::kLong)
                           .clamp_max(config.numEmbeddings - 1);
  at::Tensor values = at::sin(indices.to(at::kFloat) * 0.7) + 0.5;
  at::Tensor target = values.mean(1, /*keepdim=*/true);
  return {indices, target};
}

// The flattened values of `tensors`, in order.
at::Tensor flatten(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> flat;
  for (const auto& t : tensors) {
    flat.push_back(t.detach().reshape({-1}));
  }
  return at::cat(flat);
}

// The rendezvous address of the RPC store, as the library reads it.
std::pair<std::string, int> master(const torchrpc::Options& options) {
  std::string addr = options.launch.masterAddr;
  int port = options.launch.masterPort;
  if (addr.empty()) {
    const char* env = std::getenv("MASTER_ADDR");
    addr = env != nullptr ? env : "127.0.0.1";
  }
  if (port == 0) {
    const char* env = std::getenv("MASTER_PORT");
    port = env != nullptr
        ? std::atoi(env)
        : torchrpc::rpc::LaunchEnvironment::kDefaultMasterPort;
  }
  return {addr, port};
}

c10::intrusive_ptr<c10d::ProcessGroupGloo> trainerGroup(
    const torchrpc::Options& options,
    int trainer,
    int trainers) {
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<::gloo::transport::Device> device;
  if (const char* file = std::getenv(kStoreFileVariable)) {
    store = c10::make_intrusive<c10d::FileStore>(file, trainers);
    device = c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  } else {
    // Rank 0 (on MASTER_ADDR) serves it, one port above the RPC store's.
    c10d::TCPStoreOptions opts;
    auto [addr, port] = master(options);
    opts.port = uint16_t(port + 1);
    opts.isServer = false;
    opts.waitWorkers = false;
    store = c10::make_intrusive<c10d::TCPStore>(addr, opts);
    device = c10d::ProcessGroupGloo::createDefaultDevice();
  }
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("ddp_rpc/", store);
  auto pgOptions = c10d::ProcessGroupGloo::Options::create();
  pgOptions->devices.push_back(device);
  pgOptions->threads = 2;
  return c10::make_intrusive<c10d::ProcessGroupGloo>(
      prefixed,
      trainer - 1,
      trainers,
      pgOptions);
}

int runServer(torchrpc::Runtime& rt, const Config& config) {
  struct State {
    std::mutex mutex;
    std::optional<RemoteTable> table;
  };
  auto state = std::make_shared<State>();
  registerTable(rt);
  rt.functions().add("ddp_rpc.ready", [state]() {
    std::lock_guard<std::mutex> guard(state->mutex);
    return state->table.has_value();
  });
  rt.functions().add("ddp_rpc.table", [state]() {
    std::lock_guard<std::mutex> guard(state->mutex);
    TORCH_CHECK(state->table, "the embedding does not exist yet");
    return *state->table;
  });
  rt.start();
  RemoteTable table = RemoteTable::withTypeName(
      rt,
      "worker0/cpu",
      kTableType,
      config.numEmbeddings,
      config.embeddingDim,
      config.seed);
  {
    std::lock_guard<std::mutex> guard(state->mutex);
    state->table = table;
  }
  std::cout << "server: embedding " << config.numEmbeddings << "x"
            << config.embeddingDim << ", " << config.trainers << " trainers"
            << std::endl;
  // Serves lookups, backward passes and steps until every trainer is done.
  return rt.shutdown() ? 0 : 1;
}

int runTrainer(torchrpc::Runtime& rt, const Config& config, int trainer) {
  const std::string who = "trainer" + std::to_string(trainer);
  rt.start();
  auto pg = trainerGroup(rt.options(), trainer, config.trainers);

  // The dense replica: identical everywhere, as DDP makes it, by taking
  // trainer 1's initial values (each trainer draws different ones first).
  torch::manual_seed(config.seed + trainer);
  torch::nn::Linear dense(config.embeddingDim, 1);
  {
    torch::NoGradGuard noGrad;
    std::vector<at::Tensor> flat{flatten(dense->parameters())};
    pg->broadcast(flat)->wait();
    int64_t offset = 0;
    for (auto& p : dense->parameters()) {
      p.copy_(flat[0].slice(0, offset, offset + p.numel()).view_as(p));
      offset += p.numel();
    }
  }
  torch::optim::SGD denseOpt(
      dense->parameters(),
      torch::optim::SGDOptions(config.denseLr));

  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!rt.rpcSync<bool>("worker0", "ddp_rpc.ready")) {
    TORCH_CHECK(
        std::chrono::steady_clock::now() < deadline,
        "the server's embedding never appeared");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  auto table = rt.rpcSync<RemoteTable>("worker0", "ddp_rpc.table");
  torchrpc::optim::DistributedOptimizer tableOpt(
      rt,
      table.remoteParameters(),
      torch::optim::SGDOptions(config.embeddingLr));

  std::vector<at::Tensor> params = dense->parameters();
  double lossSum = 0;
  int64_t lossCount = 0;
  for (int64_t step = 1; step <= config.steps; ++step) {
    auto [indices, target] = batch(config, step, trainer);
    double lossValue = 0;
    {
      torchrpc::autograd::Context context(rt);
      at::Tensor features = table.forward(indices); // on the server
      at::Tensor loss = torch::mse_loss(dense->forward(features), target);
      context.backward({loss});
      lossValue = loss.item<double>();

      // DDP's part, by hand: average the dense gradients over the trainers.
      auto grads = context.gradients();
      std::vector<at::Tensor> local;
      for (const auto& p : params) {
        local.push_back(grads.contains(p) ? grads.at(p) : at::zeros_like(p));
      }
      std::vector<at::Tensor> flat{flatten(local)};
      pg->allreduce(flat)->wait();
      flat[0].div_(double(config.trainers));
      int64_t offset = 0;
      for (auto& p : params) {
        p.mutable_grad() =
            flat[0].slice(0, offset, offset + p.numel()).view_as(p).clone();
        offset += p.numel();
      }
      denseOpt.step();
      // The embedding, where it lives, with this context's gradients.
      tableOpt.step(context.id());
    }
    lossSum += lossValue;
    ++lossCount;
    if (step % config.printEvery == 0 || step == config.steps) {
      // The mean over the trainers and the steps since the last line.
      std::vector<at::Tensor> mean{
          at::tensor({lossSum, double(lossCount)}, at::kDouble)};
      pg->allreduce(mean)->wait();
      if (trainer == 1) {
        std::cout << "step " << step << "/" << config.steps << " loss "
                  << std::fixed << std::setprecision(5)
                  << (mean[0][0] / mean[0][1]).item<double>() << std::endl;
      }
      lossSum = 0;
      lossCount = 0;
    }
  }

  // Every replica must still be the same, bit for bit.
  at::Tensor mine = flatten(params);
  std::vector<std::vector<at::Tensor>> all(1);
  for (int i = 0; i < config.trainers; ++i) {
    all[0].push_back(at::empty_like(mine));
  }
  std::vector<at::Tensor> input{mine};
  pg->allgather(all, input)->wait();
  bool identical = true;
  for (const auto& other : all[0]) {
    identical = identical && at::equal(other, mine);
  }
  if (identical) {
    std::cout << who << ": dense replicas identical across " << config.trainers
              << " trainers (" << mine.numel() << " parameters)" << std::endl;
  } else {
    std::cout << who << ": dense replicas DIFFER across trainers" << std::endl;
  }
  pg->barrier()->wait();
  bool clean = rt.shutdown();
  return identical ? (clean ? 0 : 1) : 3;
}

bool startedByLauncher() {
  return torchrpc::rpc::LaunchEnvironment::fromEnvironment().launcher !=
      torchrpc::rpc::Launcher::kNone;
}

int runWorker(Config config) {
  at::set_num_threads(1);
  auto options = torchrpc::Options::fromEnvironment();
  TORCH_CHECK(
      options.worldSize >= 2,
      "WORLD_SIZE is ",
      options.worldSize,
      ": a server and at least one trainer are needed");
  config.trainers = int(options.worldSize - 1);
  // The trainers' group store, when no file is given: served by rank 0.
  std::optional<c10::intrusive_ptr<c10d::TCPStore>> groupStore;
  if (options.rank == 0 && std::getenv(kStoreFileVariable) == nullptr) {
    c10d::TCPStoreOptions opts;
    opts.port = uint16_t(master(options).second + 1);
    opts.isServer = true;
    opts.waitWorkers = false;
    groupStore = c10::make_intrusive<c10d::TCPStore>("0.0.0.0", opts);
  }
  torchrpc::Runtime rt("worker" + std::to_string(options.rank), options);
  if (options.rank == 0) {
    return runServer(rt, config);
  }
  return runTrainer(rt, config, int(options.rank));
}

} // namespace

int main(int argc, char** argv) {
  Config config;
  CLI::App app(
      "DDP + RPC: trainers keep a dense part replicated with c10d's Gloo "
      "allreduce while a large embedding lives on a parameter server behind "
      "a RemoteModule (torchrpc).\nRun as is, it starts every worker itself; "
      "under a launcher each process is the worker RANK names: 0 the server, "
      "1..N the trainers.",
      "ddp_rpc");
  app.option_defaults()->always_capture_default();
  app.add_option("--trainers", config.trainers, "trainers (local mode)")
      ->check(CLI::Range(1, 64));
  app.add_option("--steps", config.steps, "training steps of each trainer")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch-size", config.batchSize, "bags per step")
      ->check(CLI::PositiveNumber);
  app.add_option("--bag-size", config.bagSize, "indices per bag")
      ->check(CLI::PositiveNumber);
  app.add_option("--num-embeddings", config.numEmbeddings, "embedding rows")
      ->check(CLI::PositiveNumber);
  app.add_option("--dense-lr", config.denseLr, "the dense part's SGD rate");
  app.add_option(
      "--embedding-lr",
      config.embeddingLr,
      "the embedding's SGD rate");
  app.add_option("--print-every", config.printEvery, "steps between losses")
      ->check(CLI::PositiveNumber);
  app.add_option("--seed", config.seed, "initial parameters and data");
  CLI11_PARSE(app, argc, argv);

  if (!startedByLauncher()) {
    // The trainers' group meets in a file of its own.
    std::string path =
        (std::filesystem::temp_directory_path() / "ddp_rpc_store_XXXXXX")
            .string();
    int fd = ::mkstemp(path.data());
    if (fd < 0) {
      std::cerr << "ddp_rpc: cannot create " << path << std::endl;
      return 1;
    }
    ::close(fd);
    ::setenv(kStoreFileVariable, path.c_str(), 1);
    int code = ps::launchLocally(config.trainers + 1, [&config]() {
      return runWorker(config);
    });
    std::filesystem::remove(path);
    return code;
  }
  try {
    return runWorker(config);
  } catch (const c10::Error& e) {
    std::cerr << "ddp_rpc: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "ddp_rpc: " << e.what() << std::endl;
    return 1;
  }
}
