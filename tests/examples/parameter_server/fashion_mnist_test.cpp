// Tier 1: unpacking and reading Debian's Fashion-MNIST, and sharding it.

#include "fashion_mnist.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "progress.h"

namespace {

namespace fs = std::filesystem;

// Debian's dataset-fashion-mnist puts them here.
const char* kDebianDir = "/usr/share/datasets/fashion-mnist";

fs::path scratch(const std::string& name) {
  fs::path dir = fs::temp_directory_path() /
      ("fashion_mnist_test." + name + "." + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

TEST(FashionMnist, MissingFilesAreNamedWithThePackageThatShipsThem) {
  fs::path empty = scratch("empty");
  try {
    ps::unpackFashionMnist(empty.string(), (empty / "cache").string());
    ADD_FAILURE() << "no error for an empty folder";
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    for (const char* needed :
         {"train-images-idx3-ubyte.gz",
          "train-labels-idx1-ubyte.gz",
          "t10k-images-idx3-ubyte.gz",
          "t10k-labels-idx1-ubyte.gz",
          "dataset-fashion-mnist"}) {
      EXPECT_NE(what.find(needed), std::string::npos) << needed << ": " << what;
    }
  }
  fs::remove_all(empty);
}

TEST(FashionMnist, UnpacksOnceAndRepairsATruncatedFile) {
  if (!fs::exists(kDebianDir)) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  fs::path cache = scratch("cache");
  ps::unpackFashionMnist(kDebianDir, cache.string());
  fs::path images = cache / "train-images-idx3-ubyte";
  ASSERT_EQ(fs::file_size(images), 16u + 60000u * 28 * 28);
  auto written = fs::last_write_time(images);
  ps::unpackFashionMnist(kDebianDir, cache.string());
  EXPECT_EQ(fs::last_write_time(images), written) << "unpacked again";
  fs::resize_file(images, 1000);
  ps::unpackFashionMnist(kDebianDir, cache.string());
  EXPECT_EQ(fs::file_size(images), 16u + 60000u * 28 * 28);
  for (const auto& entry : fs::directory_iterator(cache)) {
    EXPECT_EQ(entry.path().string().find(".partial"), std::string::npos)
        << entry.path();
  }

  ps::Examples train = ps::loadFashionMnist(cache.string(), true);
  ps::Examples test = ps::loadFashionMnist(cache.string(), false);
  EXPECT_EQ(train.images.sizes(), (std::vector<int64_t>{60000, 784}));
  EXPECT_EQ(test.size(), 10000);
  EXPECT_EQ(train.labels.min().item<int64_t>(), 0);
  EXPECT_EQ(train.labels.max().item<int64_t>(), 9);
  // Normalized with the data set's own mean and deviation.
  EXPECT_NEAR(train.images.mean().item<double>(), 0.0, 0.01);
  EXPECT_NEAR(train.images.std().item<double>(), 1.0, 0.01);
  fs::remove_all(cache);
}

TEST(FashionMnist, ShardsAreEqualAndDisjoint) {
  ps::Examples all{
      at::arange(10, at::kFloat).unsqueeze(1),
      at::arange(10, at::kLong)};
  at::Tensor seen = at::zeros({10}, at::kLong);
  for (int index = 0; index < 3; ++index) {
    ps::Examples part = ps::shard(all, index, 3);
    EXPECT_EQ(part.size(), 3);
    EXPECT_TRUE(at::equal(part.images.squeeze(1).to(at::kLong), part.labels));
    seen.index_add_(0, part.labels, at::ones({3}, at::kLong));
  }
  EXPECT_EQ(seen.max().item<int64_t>(), 1);
  EXPECT_THROW(ps::shard(all, 3, 3), c10::Error);
}

TEST(Progress, DurationsReadAsClockTimes) {
  EXPECT_EQ(ps::formatDuration(0), "0:00");
  EXPECT_EQ(ps::formatDuration(65.4), "1:05");
  EXPECT_EQ(ps::formatDuration(3 * 3600 + 62), "3:01:02");
}

} // namespace
