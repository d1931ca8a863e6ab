#pragma once

// Fashion-MNIST as Debian's dataset-fashion-mnist package ships it (four
// gzip-compressed idx files), read through libtorch's dataset API.

#include <ATen/ATen.h>

#include <string>

namespace ps {

// Images as float rows of 784 pixels, normalized; labels as int64 in [0, 10).
struct Examples {
  at::Tensor images;
  at::Tensor labels;

  int64_t size() const {
    return labels.size(0);
  }
};

// Unpacks the four .gz files of `dataDir` into `cacheDir` (created if
// needed; files already there with the right size are kept) and returns
// the folder libtorch's MNIST reader reads. Safe when several processes
// unpack at once: each file is written under a private name, then renamed.
// Throws c10::Error naming the missing files and the Debian package that
// ships them.
std::string unpackFashionMnist(
    const std::string& dataDir,
    const std::string& cacheDir);

// The training set (60000) or the test set (10000), from an unpacked folder.
Examples loadFashionMnist(const std::string& unpackedDir, bool train);

// Trainer `index`'s shard of `count`: every count-th example from index,
// cut so that every shard has the same size (and so every trainer the same
// number of steps per epoch).
Examples shard(const Examples& all, int index, int count);

} // namespace ps
