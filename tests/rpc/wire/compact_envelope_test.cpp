// Tier 1: the compact envelope layout (Note [Compact envelopes] in
// rpc/wire/compact_envelope.h): what fits travels compactly and reads back
// field for field; what does not fit goes as protobuf; malformed bytes are
// refused, never read past their end.

#include "torchrpc/rpc/wire/compact_envelope.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "proto/rpc/envelope.pb.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/wire/envelope.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace {

// protobuf's encoding with map entries in key order: equal strings mean
// equal envelopes, bit for bit (a double's sign and NaN payload included,
// which a field comparison would not tell apart).
std::string canonical(const wire::Envelope& envelope) {
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    envelope.SerializeToCodedStream(&coded);
  }
  return out;
}

// A request with every field the compact layout carries, at the edges of
// their widths.
wire::Envelope everyCompactField() {
  wire::Envelope envelope;
  envelope.set_version(kWireVersion);
  envelope.set_id(std::numeric_limits<uint64_t>::max());
  envelope.set_kind(0xfedcba98u);
  envelope.set_from_worker(-3);
  envelope.set_timeout_ms(60000);
  envelope.set_traced(true);
  envelope.set_body(std::string("fn\0\xff", 4));
  (*envelope.mutable_metadata())["autograd"] = std::string("\x01\0\x02", 3);
  (*envelope.mutable_metadata())["trace ~"] = "";
  auto* dense = envelope.add_tensors();
  dense->set_dtype(6);
  dense->add_sizes(2);
  dense->add_sizes(0);
  dense->add_sizes(std::numeric_limits<int64_t>::min());
  dense->set_requires_grad(true);
  dense->set_device_type(-1);
  dense->set_device_index(std::numeric_limits<int32_t>::max());
  auto* scalar = envelope.add_tensors();
  scalar->set_dtype(255);
  for (int d = 0; d < 255; ++d) {
    scalar->add_sizes(1);
  }
  envelope.add_values()->mutable_none();
  envelope.add_values()->set_bool_value(false);
  envelope.add_values()->set_bool_value(true);
  envelope.add_values()->set_int_value(std::numeric_limits<int64_t>::min());
  envelope.add_values()->set_int_value(0);
  envelope.add_values()->set_double_value(-0.0);
  uint64_t nanBits = 0x7ff4000000000123ull; // a signalling NaN with a payload
  double nan;
  std::memcpy(&nan, &nanBits, sizeof(nan));
  envelope.add_values()->set_double_value(nan);
  envelope.add_values()->set_double_value(
      std::numeric_limits<double>::infinity());
  envelope.add_values()->set_string_value(std::string("\xc3\x28\0", 3));
  envelope.add_values()->set_string_value("");
  envelope.add_values()->set_tensor_index(0);
  envelope.add_values()->set_tensor_index(0xffffffffu);
  return envelope;
}

std::vector<wire::Envelope> compactEnvelopes() {
  std::vector<wire::Envelope> all{everyCompactField()};
  wire::Envelope response;
  response.set_version(kWireVersion);
  response.set_id(9);
  response.set_kind(17);
  response.set_is_response(true);
  response.set_from_worker(1);
  auto* tensor = response.add_tensors();
  tensor->set_dtype(6);
  tensor->add_sizes(1);
  response.add_values()->set_tensor_index(0);
  all.push_back(response);
  wire::Envelope bare; // a heartbeat: nothing but its kind
  bare.set_version(kWireVersion);
  bare.set_kind(2);
  all.push_back(bare);
  all.push_back(wire::Envelope()); // every field zero
  wire::Envelope full; // each count at its maximum
  full.set_version(kWireVersion);
  for (int i = 0; i < 255; ++i) {
    (*full.mutable_metadata())["k" + std::to_string(i)] = "v";
    full.add_tensors()->set_dtype(1);
    full.add_values()->set_int_value(i);
  }
  all.push_back(full);
  return all;
}

std::string compactOf(const wire::Envelope& envelope) {
  std::string bytes;
  EXPECT_TRUE(writeCompactEnvelope(envelope, &bytes));
  return bytes;
}

wire::Envelope readBack(const std::string& bytes) {
  wire::Envelope parsed;
  EXPECT_TRUE(readCompactEnvelope(bytes.data(), bytes.size(), &parsed));
  return parsed;
}

TEST(CompactEnvelope, FlatEnvelopesReadBackFieldForField) {
  for (const auto& envelope : compactEnvelopes()) {
    std::string bytes;
    ASSERT_TRUE(writeCompactEnvelope(envelope, &bytes))
        << envelope.ShortDebugString();
    ASSERT_TRUE(isCompactEnvelope(bytes));
    EXPECT_EQ(canonical(readBack(bytes)), canonical(envelope))
        << envelope.ShortDebugString();
    // What the codec sends and reads is the same.
    EXPECT_EQ(serializeEnvelope(envelope), bytes);
    wire::Envelope parsed;
    parsed.set_body("left over from an earlier message");
    parsed.add_values()->mutable_list();
    ASSERT_TRUE(parseEnvelope(bytes, &parsed));
    EXPECT_EQ(canonical(parsed), canonical(envelope));
  }
}

// The layout of Note [Compact envelopes], byte for byte, for a one-element
// call's response.
TEST(CompactEnvelope, TheLayoutIsTheNotes) {
  const std::string expected = std::string(
      "\x00"
      "\x02\x00\x00\x00" // version
      "\x01" // flags: a response
      "\x11\x00\x00\x00" // kind 17
      "\x09\x00\x00\x00\x00\x00\x00\x00" // id
      "\x01\x00\x00\x00\x00\x00\x00\x00" // from
      "\x00\x00\x00\x00\x00\x00\x00\x00" // timeout
      "\x00\x00\x00\x00" // body length
      "\x00" // metadata entries
      "\x01" // descriptors
      "\x06\x00" // float, no grad
      "\x00\x00\x00\x00\x00\x00\x00\x00" // device
      "\x01\x01\x00\x00\x00\x00\x00\x00\x00" // [1]
      "\x01" // values
      "\x06\x00\x00\x00\x00", // tensor 0
      65);
  ASSERT_EQ(kWireVersion, 2u);
  EXPECT_EQ(compactOf(compactEnvelopes()[1]), expected);
}

// What protobuf's parser keeps of a field a newer peer sent.
void addUnknownField(google::protobuf::Message* message) {
  message->GetReflection()->MutableUnknownFields(message)->AddVarint(99, 1);
}

// Each case changes a fitting envelope into one the layout cannot carry.
TEST(CompactEnvelope, WhatDoesNotFitGoesAsProtobuf) {
  std::vector<std::pair<std::string, std::function<void(wire::Envelope&)>>>
      cases{
          {"a status",
           [](wire::Envelope& e) { e.mutable_status()->set_code(4); }},
          {"an empty status", [](wire::Envelope& e) { e.mutable_status(); }},
          {"a list value",
           [](wire::Envelope& e) {
             e.add_values()->mutable_list()->add_elements()->set_int_value(1);
           }},
          {"a tuple value",
           [](wire::Envelope& e) { e.add_values()->mutable_tuple(); }},
          {"a complex value",
           [](wire::Envelope& e) {
             e.add_values()->mutable_complex_value()->set_real(1);
           }},
          {"a device value",
           [](wire::Envelope& e) { e.add_values()->mutable_device(); }},
          {"an extension value",
           [](wire::Envelope& e) {
             e.add_values()->mutable_extension()->set_kind("rref");
           }},
          {"a value of no kind", [](wire::Envelope& e) { e.add_values(); }},
          {"a sparse descriptor",
           [](wire::Envelope& e) {
             e.mutable_tensors(0)->set_layout(wire::TensorDesc::SPARSE_COO);
           }},
          {"a sparse dimension",
           [](wire::Envelope& e) { e.mutable_tensors(0)->set_sparse_dim(1); }},
          {"a non-zero count",
           [](wire::Envelope& e) { e.mutable_tensors(0)->set_nnz(1); }},
          {"a coalesced flag",
           [](wire::Envelope& e) {
             e.mutable_tensors(0)->set_coalesced(true);
           }},
          {"a dtype over a byte",
           [](wire::Envelope& e) { e.mutable_tensors(0)->set_dtype(256); }},
          {"256 dimensions",
           [](wire::Envelope& e) { e.mutable_tensors(1)->add_sizes(1); }},
          {"256 descriptors",
           [](wire::Envelope& e) {
             while (e.tensors_size() < 256) {
               e.add_tensors();
             }
           }},
          {"256 values",
           [](wire::Envelope& e) {
             while (e.values_size() < 256) {
               e.add_values()->set_int_value(1);
             }
           }},
          {"256 metadata entries",
           [](wire::Envelope& e) {
             for (int i = 0; e.metadata_size() < 256; ++i) {
               (*e.mutable_metadata())["m" + std::to_string(i)] = "";
             }
           }},
          {"a metadata key of 256 bytes",
           [](wire::Envelope& e) {
             (*e.mutable_metadata())[std::string(256, 'k')] = "";
           }},
          {"a metadata key with a control character",
           [](wire::Envelope& e) { (*e.mutable_metadata())["a\tb"] = ""; }},
          {"a field this build does not know",
           [](wire::Envelope& e) { addUnknownField(&e); }},
          {"a descriptor field this build does not know",
           [](wire::Envelope& e) { addUnknownField(e.mutable_tensors(0)); }},
          {"a value field this build does not know",
           [](wire::Envelope& e) { addUnknownField(e.mutable_values(0)); }},
          {"a none field this build does not know",
           [](wire::Envelope& e) {
             addUnknownField(e.mutable_values(0)->mutable_none());
           }},
          {"a non-ASCII metadata key",
           [](wire::Envelope& e) {
             (*e.mutable_metadata())["caf\xc3\xa9"] = "";
           }},
      };
  for (const auto& [what, change] : cases) {
    wire::Envelope envelope = everyCompactField();
    change(envelope);
    std::string bytes;
    EXPECT_FALSE(writeCompactEnvelope(envelope, &bytes)) << what;
    const std::string sent = serializeEnvelope(envelope);
    EXPECT_FALSE(isCompactEnvelope(sent)) << what;
    EXPECT_EQ(sent, envelope.SerializeAsString()) << what;
    wire::Envelope parsed;
    ASSERT_TRUE(parseEnvelope(sent, &parsed)) << what;
    EXPECT_EQ(canonical(parsed), canonical(envelope)) << what;
  }
}

TEST(CompactEnvelope, EveryTruncationAndTrailingByteIsRefused) {
  std::string bytes;
  ASSERT_TRUE(writeCompactEnvelope(everyCompactField(), &bytes));
  for (size_t size = 0; size < bytes.size(); ++size) {
    wire::Envelope parsed;
    EXPECT_FALSE(readCompactEnvelope(bytes.data(), size, &parsed)) << size;
    if (size > 0) {
      EXPECT_FALSE(parseEnvelope(bytes.substr(0, size), &parsed)) << size;
    }
  }
  wire::Envelope parsed;
  EXPECT_FALSE(parseEnvelope(bytes + '\0', &parsed));
  EXPECT_FALSE(parseEnvelope(bytes + "xyz", &parsed));
}

// Offsets of Note [Compact envelopes]'s fixed part.
constexpr size_t kFlagsAt = 5;
constexpr size_t kBodyLengthAt = 1 + 4 + 1 + 4 + 8 + 8 + 8;

bool parses(const std::string& bytes) {
  wire::Envelope parsed;
  return parseEnvelope(bytes, &parsed);
}

TEST(CompactEnvelope, MalformedFieldsAreRefused) {
  wire::Envelope one;
  one.set_version(kWireVersion);
  one.set_body("f");
  const std::string base = compactOf(one);
  ASSERT_TRUE(parses(base));
  // base: fixed part, body "f", then three zero counts.
  ASSERT_EQ(base.size(), kBodyLengthAt + 4 + 1 + 3);

  std::string unknownFlag = base;
  unknownFlag[kFlagsAt] = 4;
  EXPECT_FALSE(parses(unknownFlag));

  // A body length past the end (2^32 - 1) is refused before anything is
  // taken from it.
  std::string longBody = base;
  longBody.replace(kBodyLengthAt, 4, "\xff\xff\xff\xff");
  EXPECT_FALSE(parses(longBody));

  const std::string head = base.substr(0, base.size() - 3);
  auto withValue = [&head](const std::string& value) {
    return head + '\0' + '\0' + '\1' + value;
  };
  EXPECT_TRUE(parses(withValue("\x02\x01")));
  EXPECT_FALSE(parses(withValue("\x02\x02"))); // a bool that is 2
  EXPECT_FALSE(parses(withValue(std::string(1, '\0')))); // tag 0
  EXPECT_FALSE(parses(withValue("\x07"))); // tag 7
  EXPECT_FALSE(parses(withValue("\xff")));
  EXPECT_FALSE(
      parses(withValue("\x05\xff\xff\xff\x7f"
                       "abc"))); // long bytes
  EXPECT_FALSE(parses(head + '\0' + '\0' + '\2' + "\x01")); // one value short

  auto withDescriptor = [&head](const std::string& descriptor) {
    return head + '\0' + '\1' + descriptor + '\0';
  };
  const std::string device(8, '\0');
  EXPECT_TRUE(parses(withDescriptor(std::string("\x06\x01") + device + '\0')));
  EXPECT_FALSE(parses(withDescriptor(std::string("\x06\x02") + device + '\0')));
  // 200 dimensions announced, one given.
  EXPECT_FALSE(parses(withDescriptor(
      std::string("\x06\x00", 2) + device + "\xc8" + std::string(8, '\1'))));

  auto withMetadata = [&head](const std::string& entries, char count) {
    return head + count + entries + '\0' + '\0';
  };
  const std::string entry = std::string("\x01k\x01\0\0\0v", 7);
  EXPECT_TRUE(parses(withMetadata(entry, 1)));
  EXPECT_FALSE(parses(withMetadata(entry + entry, 2))); // the same key twice
  EXPECT_FALSE(parses(withMetadata(std::string("\x01\n\0\0\0\0", 6), 1)));
  EXPECT_FALSE(parses(withMetadata(std::string("\x01\x80\0\0\0\0", 6), 1)));
  EXPECT_FALSE(parses(withMetadata(entry, 2))); // one entry short
}

TEST(CompactEnvelope, TheCodecChecksTheVersionOfACompactHeader) {
  wire::Envelope future;
  future.set_version(kWireVersion + 1);
  Message message;
  message.header = compactOf(future);
  MessageCodec codec(WorkerInfo{"worker1", 1}, Options());
  wire::Envelope parsed;
  try {
    codec.parse(message.header, &parsed);
    FAIL() << "a header of another version was accepted";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMalformedMessage);
    EXPECT_EQ(
        e.detail(),
        "wire version " + std::to_string(kWireVersion + 1) +
            ", this worker speaks " + std::to_string(kWireVersion));
  }
  message.header = compactOf(everyCompactField());
  message.header.pop_back();
  try {
    codec.parse(message.header, &parsed);
    FAIL() << "a truncated header was accepted";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), ErrorCode::kMalformedMessage);
    EXPECT_EQ(e.detail(), "header is not an envelope");
  }
}

} // namespace
} // namespace detail
} // namespace rpc
} // namespace torchrpc
