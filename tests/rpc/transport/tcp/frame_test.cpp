// Tier 1: TCP framing as values (Note [TCP transport wire format],
// rpc/transport/tcp/frame.h). Header bytes checked against hand-written
// ones (tests/support/tcp_peers.h), refusals checked by their messages.

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tests/support/tcp_peers.h"
#include "torchrpc/rpc/transport/tcp/frame.h"
#include "torchrpc/rpc/transport/transport.h"

namespace torchrpc {
namespace rpc {
namespace {

using namespace detail::tcp;

FrameHeader decode(const std::string& bytes) {
  EXPECT_EQ(bytes.size(), kFrameHeaderBytes);
  return decodeFrameHeader(
      reinterpret_cast<const unsigned char*>(bytes.data()));
}

std::vector<uint64_t> wireWords(const std::string& bytes) {
  std::vector<uint64_t> words(bytes.size() / 8);
  std::memcpy(words.data(), bytes.data(), words.size() * 8);
  return words;
}

TEST(TcpFrame, HeaderEncodesAsTheNoteSays) {
  EXPECT_EQ(
      encodeFrameHeader(FrameType::kData, 5, 2),
      harness::rawFrameHeader(4, 5, 2));
  EXPECT_EQ(
      encodeFrameHeader(FrameType::kHello, 0xffffffffu, 0),
      harness::rawFrameHeader(1, 0xffffffffu, 0));
  EXPECT_EQ(encodeFrameHeader(FrameType::kClose, 0, 0).substr(0, 4), "TRPC");
}

TEST(TcpFrame, HeaderRoundTrips) {
  FrameHeader header =
      decode(encodeFrameHeader(FrameType::kDataCma, 123456, 789));
  EXPECT_EQ(header.magic, kMagic);
  EXPECT_EQ(header.version, kVersion);
  EXPECT_EQ(header.type, FrameType::kDataCma);
  EXPECT_EQ(header.reserved, 0);
  EXPECT_EQ(header.bodyBytes, 123456u);
  EXPECT_EQ(header.count, 789u);
  EXPECT_EQ(checkFrameHeader(header), "");
}

TEST(TcpFrame, BadHeadersAreRefusedWithTheirReason) {
  std::string bytes = encodeFrameHeader(FrameType::kData, 0, 0);
  std::string badMagic = bytes;
  badMagic[0] = 'X';
  EXPECT_EQ(
      checkFrameHeader(decode(badMagic)),
      "not a torchrpc TCP frame (bad magic)");
  std::string badVersion = bytes;
  badVersion[4] = 2;
  EXPECT_EQ(
      checkFrameHeader(decode(badVersion)),
      "unsupported protocol version 2");
  std::string reserved = bytes;
  reserved[7] = 1;
  EXPECT_EQ(checkFrameHeader(decode(reserved)), "reserved frame bits set");
}

TEST(TcpFrame, DataFrameCapsAreCheckedBeforeAllocating) {
  TransportLimits limits;
  limits.maxTensorsPerMessage = 4;
  limits.maxHeaderBytes = 100;
  limits.maxMessageBytes = 1000;
  FrameHeader header = decode(encodeFrameHeader(FrameType::kData, 100, 4));
  EXPECT_EQ(checkDataFrameCaps(header, limits), "");
  header.count = 5;
  EXPECT_EQ(
      checkDataFrameCaps(header, limits),
      "5 tensors exceed the cap of 4");
  header.count = 0;
  header.bodyBytes = 101;
  EXPECT_EQ(
      checkDataFrameCaps(header, limits),
      "header of 101 bytes exceeds the cap of 100");
  limits.maxHeaderBytes = 5000;
  header.bodyBytes = 1001;
  EXPECT_EQ(
      checkDataFrameCaps(header, limits),
      "message exceeds the cap of 1000 bytes");
}

TEST(TcpFrame, TensorLengthsAreDecodedAndCappedWithoutWrapping) {
  TransportLimits limits;
  limits.maxMessageBytes = 1000;
  std::string wire;
  for (uint64_t length : {uint64_t(300), uint64_t(0), uint64_t(600)}) {
    harness::putLe(wire, length, 8);
  }
  std::vector<uint64_t> lengths = wireWords(wire);
  EXPECT_EQ(decodeTensorLengths(lengths, 100, limits), "");
  EXPECT_EQ(lengths, (std::vector<uint64_t>{300, 0, 600}));

  lengths = wireWords(wire);
  EXPECT_EQ(
      decodeTensorLengths(lengths, 101, limits),
      "message exceeds the cap of 1000 bytes");

  // Two lengths whose sum wraps to 500, under the cap.
  std::string wrapping;
  harness::putLe(wrapping, 600, 8);
  harness::putLe(wrapping, ~uint64_t(0) - 99, 8);
  lengths = wireWords(wrapping);
  EXPECT_EQ(
      decodeTensorLengths(lengths, 0, limits),
      "message exceeds the cap of 1000 bytes");
}

TEST(TcpFrame, DataPrefixCarriesLengthsAndForZeroCopyTheAddresses) {
  std::string plain = encodeDataPrefix(7, {3, 0}, 0, {});
  std::string want = harness::rawFrameHeader(4, 7, 2);
  harness::putLe(want, 3, 8);
  harness::putLe(want, 0, 8);
  EXPECT_EQ(plain, want);

  std::string cma = encodeDataPrefix(7, {3, 1 << 20}, 42, {0, 0xabcdef});
  std::string wantCma = harness::rawFrameHeader(9, 7, 2);
  for (uint64_t word :
       {uint64_t(3),
        uint64_t(1 << 20),
        uint64_t(42),
        uint64_t(0),
        uint64_t(0xabcdef)}) {
    harness::putLe(wantCma, word, 8);
  }
  EXPECT_EQ(cma, wantCma);
  std::vector<uint64_t> words = wireWords(cma.substr(kFrameHeaderBytes));
  decodeLeWords(words);
  EXPECT_EQ(words, (std::vector<uint64_t>{3, 1 << 20, 42, 0, 0xabcdef}));

  // In a segment: the id, then {segment, address} per tensor.
  std::string shared =
      encodeDataPrefix(7, {3, 1 << 20}, 42, {0, 0xabcdef}, {0, 5});
  std::string wantShared = harness::rawFrameHeader(11, 7, 2);
  for (uint64_t word :
       {uint64_t(3),
        uint64_t(1 << 20),
        uint64_t(42),
        uint64_t(0),
        uint64_t(0),
        uint64_t(5),
        uint64_t(0xabcdef)}) {
    harness::putLe(wantShared, word, 8);
  }
  EXPECT_EQ(shared, wantShared);
}

TEST(TcpFrame, ControlFrameIsHeaderAndBody) {
  OutFrame frame = controlFrame(FrameType::kAck, "12345678");
  EXPECT_EQ(frame.prefix, harness::rawFrameHeader(10, 8, 0));
  EXPECT_EQ(frame.body, "12345678");
  EXPECT_EQ(frame.total, kFrameHeaderBytes + 8);
  EXPECT_TRUE(frame.tensors.empty());
  EXPECT_FALSE(frame.done);
}

TEST(TcpFrame, BodyReaderNeverReadsPastTheEnd) {
  std::string body;
  body += '\x07';
  appendShortString(body, "name");
  harness::putLe(body, 0x0102030405060708ull, 8);
  BodyReader reader(body);
  uint8_t flag = 0;
  std::string name;
  uint64_t word = 0;
  ASSERT_TRUE(reader.u8(flag));
  ASSERT_TRUE(reader.shortString(name));
  ASSERT_TRUE(reader.u64(word));
  EXPECT_EQ(flag, 7);
  EXPECT_EQ(name, "name");
  EXPECT_EQ(word, 0x0102030405060708ull);
  EXPECT_TRUE(reader.atEnd());
  EXPECT_FALSE(reader.u8(flag));

  // A short string announcing more than is left.
  std::string lying;
  harness::putLe(lying, 100, 2);
  lying += "abc";
  BodyReader liar(lying);
  EXPECT_FALSE(liar.shortString(name));
  std::string shortWord = "1234567";
  BodyReader truncated(shortWord);
  EXPECT_FALSE(truncated.u64(word));
}

TEST(TcpFrame, ShortStringsAreCutAt1024Bytes) {
  std::string out;
  appendShortString(out, std::string(5000, 'x'));
  EXPECT_EQ(out.size(), 2u + 1024u);
  BodyReader reader(out);
  std::string value;
  ASSERT_TRUE(reader.shortString(value));
  EXPECT_EQ(value, std::string(1024, 'x'));
}

} // namespace
} // namespace rpc
} // namespace torchrpc
