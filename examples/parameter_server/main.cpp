// Parameter-server training of an MLP on Fashion-MNIST: one server (rank 0)
// holds the model as a RemoteModule, N trainers train it concurrently, each
// on its own shard, with distributed autograd and DistributedOptimizer.
//
//   ps_mnist                      starts the server and 2 trainers itself
//   torchrun --nproc-per-node 3 ps_mnist ...   one worker per process
//
// With no RANK (nor an MPI rank) in the environment it forks every worker
// (one command); otherwise this process is the worker
// Options::fromEnvironment() names, so any launcher that sets RANK,
// WORLD_SIZE, MASTER_ADDR and MASTER_PORT runs it unchanged.

#include <torchrpc/torchrpc.h>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "config.h"
#include "fashion_mnist.h"
#include "local_launch.h"
#include "model.h"
#include "server.h"
#include "trainer.h"

namespace {

// Whether a launcher (torchrun, torchrpc-launch, mpirun, srun) started this
// process as one worker; otherwise this process starts the workers itself.
// The library reads the launchers' variables (Note [Launch environment]).
bool startedByLauncher() {
  return torchrpc::rpc::LaunchEnvironment::fromEnvironment().launcher !=
      torchrpc::rpc::Launcher::kNone;
}

int runWorker(ps::Config config) {
  at::set_num_threads(config.torchThreads);
  auto options = torchrpc::Options::fromEnvironment();
  TORCH_CHECK(
      options.worldSize >= 2,
      "WORLD_SIZE is ",
      options.worldSize,
      ": a server and at least one trainer are needed");
  if (config.trainers != options.worldSize - 1) {
    if (options.rank == 0) {
      std::cout << "server: WORLD_SIZE " << options.worldSize << " gives "
                << options.worldSize - 1 << " trainers" << std::endl;
    }
    config.trainers = int(options.worldSize - 1);
  }
  std::string name = "worker" + std::to_string(options.rank);
  torchrpc::Runtime rt(name, options);
  int code = 0;
  if (options.rank == 0) {
    ps::ParameterServer server(rt, config);
    rt.start();
    code = server.run();
    bool clean = rt.shutdown();
    return code != 0 ? code : (clean ? 0 : 1);
  }
  ps::registerModel(rt);
  rt.start();
  code = ps::runTrainer(rt, config, int(options.rank));
  bool clean = rt.shutdown();
  return code != 0 ? code : (clean ? 0 : 1);
}

} // namespace

int main(int argc, char** argv) {
  ps::Config config;
  CLI::App app(
      "Trains an MLP (784-256-10) on Fashion-MNIST with one parameter "
      "server and N trainers (torchrpc: RemoteModule, distributed autograd, "
      "DistributedOptimizer).\nRun as is, it starts every worker itself; "
      "under a launcher (torchrun, mpirun, srun) each process is the worker "
      "RANK names: 0 the server, 1..N the trainers.",
      "ps_mnist");
  app.option_defaults()->always_capture_default();
  app.add_option(
         "--trainers",
         config.trainers,
         "trainers (local mode; a launcher's "
         "WORLD_SIZE - 1 otherwise)")
      ->check(CLI::Range(1, 64));
  app.add_option("--epochs", config.epochs, "passes over each trainer's shard")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch-size", config.batchSize, "examples per step")
      ->check(CLI::PositiveNumber);
  app.add_option("--lr", config.lr, "learning rate")
      ->check(CLI::PositiveNumber);
  app.add_option("--optimizer", config.optimizer, "sgd (with momentum) or adam")
      ->check(CLI::IsMember({"sgd", "adam"}));
  app.add_option("--momentum", config.momentum, "SGD's momentum");
  app.add_option("--seed", config.seed, "initial parameters and data order");
  app.add_option(
      "--data-dir",
      config.dataDir,
      "Fashion-MNIST's four .gz files (Debian: dataset-fashion-mnist)");
  app.add_option(
      "--cache-dir",
      config.cacheDir,
      "where they are unpacked (default: <temp dir>/torchrpc-fashion-mnist)");
  app.add_option(
      "--checkpoint-dir",
      config.checkpointDir,
      "checkpoints, on the server: one each epoch and at the end");
  app.add_flag(
      "--resume",
      config.resume,
      "continue from the last checkpoint in --checkpoint-dir (model and "
      "optimizer state, step counter)");
  app.add_option(
      "--log-dir",
      config.logDir,
      "TensorBoard event files and curves.png (tensorboard --logdir DIR)");
  app.add_option(
         "--max-steps",
         config.maxSteps,
         "stop every trainer after this many steps in all (0: no limit)")
      ->check(CLI::NonNegativeNumber);
  app.add_option(
      "--progress-seconds",
      config.progressSeconds,
      "seconds between two progress lines of a trainer");
  app.add_option(
         "--torch-threads",
         config.torchThreads,
         "libtorch threads per worker")
      ->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  if (config.cacheDir.empty()) {
    config.cacheDir =
        (std::filesystem::temp_directory_path() / "torchrpc-fashion-mnist")
            .string();
  }
  try {
    // Before any worker exists: a missing data set fails at once, and each
    // file is unpacked once.
    config.cacheDir = ps::unpackFashionMnist(config.dataDir, config.cacheDir);
  } catch (const c10::Error& e) {
    std::cerr << "ps_mnist: " << e.what_without_backtrace() << std::endl;
    return 2;
  }
  if (!startedByLauncher()) {
    return ps::launchLocally(config.trainers + 1, [&config]() {
      return runWorker(config);
    });
  }
  try {
    return runWorker(config);
  } catch (const c10::Error& e) {
    std::cerr << "ps_mnist: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "ps_mnist: " << e.what() << std::endl;
    return 1;
  }
}
