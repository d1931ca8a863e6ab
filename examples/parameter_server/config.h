#pragma once

// The settings of one parameter-server training run, shared by every
// worker; main.cpp fills them from the command line.

#include <cstdint>
#include <string>

namespace ps {

struct Config {
  int trainers = 2;
  int epochs = 3;
  int64_t batchSize = 64;
  double lr = 0.01;
  std::string optimizer = "sgd"; // "sgd" (with momentum) or "adam"
  double momentum = 0.9;
  int64_t hidden = 256;
  int64_t seed = 1;
  // Where the four gzip-compressed idx files are, and where they are
  // unpacked for libtorch's MNIST reader.
  std::string dataDir = "/usr/share/datasets/fashion-mnist";
  std::string cacheDir; // empty: <temp dir>/torchrpc-fashion-mnist
  std::string checkpointDir = "ps_mnist_checkpoints";
  bool resume = false;
  std::string logDir = "runs/ps_mnist";
  // Stop every trainer after this many steps in all (0: run every epoch).
  int64_t maxSteps = 0;
  double progressSeconds = 5;
  // libtorch intra-op threads per worker: a server and two trainers already
  // share two cores.
  int torchThreads = 1;
};

} // namespace ps
