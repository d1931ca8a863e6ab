// Tier 1: the checksum and the record framing of the TensorBoard writer
// (the records' contents are checked end to end by ps_mnist_test.py, with
// an independent reader).

#include "tfevents_writer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "crc32c.h"

namespace {

TEST(Crc32c, MatchesPublishedCheckValues) {
  // The catalogue's check value, and RFC 3720's test vectors (B.4).
  EXPECT_EQ(ps::crc32c("123456789", 9), 0xE3069283u);
  std::vector<unsigned char> zeros(32, 0x00), ones(32, 0xFF), up(32);
  for (int i = 0; i < 32; ++i) {
    up[i] = uint8_t(i);
  }
  EXPECT_EQ(ps::crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(ps::crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  EXPECT_EQ(ps::crc32c(up.data(), up.size()), 0x46DD794Eu);
  EXPECT_EQ(ps::crc32c("", 0), 0u);
}

TEST(Crc32c, MaskRotatesAndAddsTensorFlowsConstant) {
  uint32_t crc = ps::crc32c("123456789", 9);
  EXPECT_EQ(
      ps::maskedCrc32c("123456789", 9),
      ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

uint64_t readUint(const std::string& bytes, size_t at, int size) {
  uint64_t value = 0;
  for (int i = size - 1; i >= 0; --i) {
    value = value << 8 | uint8_t(bytes[at + i]);
  }
  return value;
}

TEST(TfEventsWriter, EveryRecordIsFramedWithMaskedChecksums) {
  auto dir = std::filesystem::temp_directory_path() /
      ("tfevents_writer_test." + std::to_string(::getpid()));
  std::string path;
  {
    ps::TfEventsWriter writer(dir.string());
    writer.addScalar("loss/trainer1", 0.5, 10);
    writer.addScalar("loss/trainer1", 0.25, 20);
    writer.flush();
    path = writer.path();
  }
  EXPECT_EQ(
      std::filesystem::path(path).filename().string().rfind(
          "events.out.tfevents.",
          0),
      0u);
  std::ifstream in(path, std::ios::binary);
  std::string bytes(
      (std::istreambuf_iterator<char>(in)),
      std::istreambuf_iterator<char>());
  size_t at = 0;
  int records = 0;
  while (at < bytes.size()) {
    ASSERT_LE(at + 12, bytes.size());
    uint64_t length = readUint(bytes, at, 8);
    EXPECT_EQ(
        readUint(bytes, at + 8, 4),
        ps::maskedCrc32c(bytes.data() + at, 8));
    ASSERT_LE(at + 16 + length, bytes.size());
    EXPECT_EQ(
        readUint(bytes, at + 12 + length, 4),
        ps::maskedCrc32c(bytes.data() + at + 12, length));
    if (records == 0) {
      EXPECT_NE(
          bytes.substr(at + 12, length).find("brain.Event:2"),
          std::string::npos);
    }
    at += 16 + length;
    ++records;
  }
  EXPECT_EQ(records, 3);
  std::filesystem::remove_all(dir);
}

} // namespace
