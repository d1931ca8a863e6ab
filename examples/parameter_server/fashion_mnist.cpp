#include "fashion_mnist.h"

#include <torch/data/datasets/mnist.h>
#include <unistd.h>
#include <zlib.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace ps {
namespace {

namespace fs = std::filesystem;

constexpr std::array<const char*, 4> kFiles = {
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte"};

// Fashion-MNIST's mean and standard deviation of a pixel (in [0, 1]).
constexpr double kMean = 0.2860;
constexpr double kStd = 0.3530;

// The uncompressed size a gzip file records in its last four bytes (modulo
// 2^32, plenty for these files).
uint64_t recordedSize(const fs::path& gz) {
  std::ifstream in(gz, std::ios::binary);
  in.seekg(-4, std::ios::end);
  unsigned char bytes[4] = {};
  in.read(reinterpret_cast<char*>(bytes), 4);
  TORCH_CHECK(in, "cannot read ", gz.string());
  return uint64_t(bytes[0]) | uint64_t(bytes[1]) << 8 |
      uint64_t(bytes[2]) << 16 | uint64_t(bytes[3]) << 24;
}

void gunzip(const fs::path& from, const fs::path& to) {
  gzFile in = gzopen(from.c_str(), "rb");
  TORCH_CHECK(in != nullptr, "cannot open ", from.string());
  // A private name, renamed when complete: a reader never sees half a file.
  fs::path partial = to.string() + ".partial." + std::to_string(::getpid());
  std::ofstream out(partial, std::ios::binary | std::ios::trunc);
  std::vector<char> buffer(1 << 20);
  int got = 0;
  while ((got = gzread(in, buffer.data(), unsigned(buffer.size()))) > 0) {
    out.write(buffer.data(), got);
  }
  int error = Z_OK;
  std::string message = got < 0 ? gzerror(in, &error) : "";
  gzclose(in);
  out.close();
  if (got < 0 || !out) {
    fs::remove(partial);
    TORCH_CHECK(false, "cannot unpack ", from.string(), ": ", message);
  }
  fs::rename(partial, to);
}

} // namespace

std::string unpackFashionMnist(
    const std::string& dataDir,
    const std::string& cacheDir) {
  std::vector<std::string> missing;
  for (const char* name : kFiles) {
    if (!fs::is_regular_file(fs::path(dataDir) / (std::string(name) + ".gz"))) {
      missing.push_back(std::string(name) + ".gz");
    }
  }
  if (!missing.empty()) {
    std::string list;
    for (const auto& name : missing) {
      list += (list.empty() ? "" : ", ") + name;
    }
    TORCH_CHECK(
        false,
        "Fashion-MNIST is missing: ",
        dataDir,
        " has no ",
        list,
        ". Debian's package dataset-fashion-mnist ships them in "
        "/usr/share/datasets/fashion-mnist: install it (apt-get install "
        "dataset-fashion-mnist, or bash tools/setup_debian.sh), or point "
        "--data-dir at a folder that holds these files.");
  }
  fs::create_directories(cacheDir);
  for (const char* name : kFiles) {
    fs::path gz = fs::path(dataDir) / (std::string(name) + ".gz");
    fs::path unpacked = fs::path(cacheDir) / name;
    std::error_code ignored;
    if (fs::is_regular_file(unpacked) &&
        fs::file_size(unpacked, ignored) == recordedSize(gz)) {
      continue;
    }
    gunzip(gz, unpacked);
  }
  return cacheDir;
}

Examples loadFashionMnist(const std::string& unpackedDir, bool train) {
  torch::data::datasets::MNIST dataset(
      unpackedDir,
      train ? torch::data::datasets::MNIST::Mode::kTrain
            : torch::data::datasets::MNIST::Mode::kTest);
  // The reader gives [N, 1, 28, 28] in [0, 1] and int64 labels.
  at::Tensor images = dataset.images().reshape({dataset.images().size(0), -1});
  return {(images - kMean) / kStd, dataset.targets().to(at::kLong)};
}

Examples shard(const Examples& all, int index, int count) {
  TORCH_CHECK(
      count > 0 && index >= 0 && index < count,
      "shard ",
      index,
      " of ",
      count,
      " does not exist");
  int64_t each = all.size() / count;
  at::Tensor rows = at::arange(each, at::kLong) * count + index;
  return {all.images.index_select(0, rows), all.labels.index_select(0, rows)};
}

} // namespace ps
