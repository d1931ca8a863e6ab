// Bounded, seeded random-mutation fuzzing of the value decoder. See Note
// [Wire format], guarantee 3: whatever a peer sends, parsing and decoding
// either succeed or throw RpcError(kMalformedMessage), without crashing or
// allocating more than the message itself justifies.

#include "torchrpc/rpc/wire/value_codec.h"

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue_inl.h>
#include <ATen/core/jit_type.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/stubs/logging.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tests/support/wire_tensors.h"
#include "torchrpc/rpc/errors.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace {

// Fixed so that a failure reproduces; override with TORCHRPC_FUZZ_SEED.
uint64_t fuzzSeed() {
  const char* env = std::getenv("TORCHRPC_FUZZ_SEED");
  return env != nullptr ? std::strtoull(env, nullptr, 10) : 20240611;
}

constexpr int kMutatedEnvelopes = 100000;
constexpr int kDescriptorSets = 10000;
constexpr int kValueTrees = 20000;
// Stops early rather than time out on a loaded machine; the iteration count
// reached is printed.
constexpr auto kTimeBudget = std::chrono::seconds(15);

struct Seed {
  std::string envelopeBytes; // Envelope with the values' ListValue as body.
  std::vector<at::Tensor> wireTensors;
};

using harness::asWireTensors;

// Stands in for an upper layer's kind; refuses payloads it did not write.
std::vector<ValueExtension> fuzzExtensions() {
  ValueExtension extension;
  extension.kind = "fuzz.box";
  extension.matches = [](const c10::IValue& value) { return value.isFuture(); };
  extension.encode = [](const c10::IValue& value,
                        int64_t /*toWorker*/,
                        std::string* payload,
                        std::vector<c10::IValue>* nested) {
    *payload = "box";
    nested->push_back(value.toFuture()->value());
  };
  extension.decode = [](int64_t /*fromWorker*/,
                        const std::string& payload,
                        std::vector<c10::IValue>&& nested) {
    if (payload != "box" || nested.size() != 1) {
      throw std::runtime_error("bad box");
    }
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
    future->markCompleted(std::move(nested[0]));
    return c10::IValue(future);
  };
  return {extension};
}

c10::IValue boxed(c10::IValue value) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  future->markCompleted(std::move(value));
  return c10::IValue(future);
}

Seed makeSeed(
    const std::vector<c10::IValue>& values,
    const std::vector<ValueExtension>& extensions) {
  ValueEncoder encoder(1, nullptr, &extensions);
  wire::ListValue body;
  for (const auto& value : values) {
    encoder.encode(value, body.add_elements());
  }
  wire::Envelope envelope;
  auto tensors = std::move(encoder).finish(&envelope);
  envelope.set_version(1);
  envelope.set_id(42);
  body.SerializeToString(envelope.mutable_body());
  Seed seed;
  envelope.SerializeToString(&seed.envelopeBytes);
  seed.wireTensors = asWireTensors(tensors);
  return seed;
}

std::vector<Seed> makeSeeds(const std::vector<ValueExtension>& extensions) {
  std::vector<std::vector<c10::IValue>> corpus;
  corpus.push_back({c10::IValue(), true, int64_t(-5), 2.5, std::string("s")});
  corpus.push_back({c10::complex<double>(1, 2), c10::Device(c10::kCPU)});
  for (auto dtype : harness::wireDtypes()) {
    corpus.push_back({at::ones({2, 3}, dtype), at::empty({0, 4}, dtype)});
  }
  corpus.push_back({at::randn({3, 2}).t().requires_grad_(true)});
  // Sparse COO: two transport tensors per descriptor, indices checked.
  corpus.push_back(
      {at::eye(4).to_sparse().requires_grad_(true),
       at::ones({3, 2, 2}).to_sparse(1).coalesce(),
       at::sparse_coo_tensor({5, 5}, at::kDouble)});
  corpus.push_back(
      {c10::List<int64_t>({1, 2, 3}),
       c10::List<double>(),
       c10::List<c10::optional<at::Tensor>>({c10::nullopt, at::ones({2})})});
  corpus.push_back({c10::List<c10::List<at::Tensor>>(
      {c10::List<at::Tensor>({at::ones({1}), at::zeros({2})})})});
  c10::Dict<std::string, at::Tensor> named;
  named.insert("w", at::randn({2, 2}));
  named.insert("b", at::randn({2}));
  c10::Dict<int64_t, c10::List<int64_t>> byInt;
  byInt.insert(1, c10::List<int64_t>({5}));
  corpus.push_back({named, byInt});
  corpus.push_back({c10::ivalue::Tuple::create(
      {int64_t(1),
       at::arange(4),
       c10::ivalue::Tuple::create({std::string("x"), c10::IValue()})})});
  c10::impl::GenericList numbers(c10::NumberType::get());
  numbers.push_back(int64_t(1));
  numbers.push_back(0.5);
  corpus.push_back({numbers, boxed(at::ones({3})), boxed(int64_t(2))});
  c10::IValue deep = at::ones({1});
  for (int i = 0; i < 20; ++i) {
    c10::impl::GenericDict dict(
        c10::StringType::get(),
        c10::unshapedType(deep.type()));
    dict.insert(std::string("k"), std::move(deep));
    deep = c10::IValue(std::move(dict));
  }
  corpus.push_back({deep});

  std::vector<Seed> seeds;
  for (const auto& values : corpus) {
    seeds.push_back(makeSeed(values, extensions));
  }
  return seeds;
}

void mutateBytes(std::string* bytes, std::mt19937_64& rng) {
  const int count = rng() % 2 ? 1 : 1 + static_cast<int>(rng() % 4);
  for (int m = 0; m < count; ++m) {
    const size_t size = bytes->size();
    auto at = [&]() {
      return size == 0
          ? 0
          : std::uniform_int_distribution<size_t>(0, size - 1)(rng);
    };
    switch (std::uniform_int_distribution<int>(0, 5)(rng)) {
      case 0: // Flip a bit.
        if (size > 0) {
          (*bytes)[at()] ^= static_cast<char>(1 << (rng() % 8));
        }
        break;
      case 1: // Overwrite a byte, often with an interesting value.
        if (size > 0) {
          static const uint8_t interesting[] = {0x00, 0x01, 0x7f, 0x80, 0xff};
          (*bytes)[at()] = static_cast<char>(
              rng() % 2 ? interesting[rng() % 5] : rng() % 256);
        }
        break;
      case 2: { // Insert random bytes.
        std::string insert(1 + rng() % 8, '\0');
        for (auto& c : insert) {
          c = static_cast<char>(rng() % 256);
        }
        bytes->insert(size == 0 ? 0 : at(), insert);
        break;
      }
      case 3: // Delete a range.
        if (size > 0) {
          size_t from = at();
          bytes->erase(from, 1 + rng() % 8);
        }
        break;
      case 4: // Truncate.
        if (size > 0) {
          bytes->resize(at());
        }
        break;
      case 5: // Duplicate a range.
        if (size > 0) {
          size_t from = at();
          bytes->insert(at(), bytes->substr(from, 1 + rng() % 16));
        }
        break;
    }
  }
}

at::Tensor randomWireTensor(std::mt19937_64& rng) {
  const int64_t length = static_cast<int64_t>(rng() % 64);
  switch (rng() % 6) {
    case 0:
      return at::Tensor();
    case 1: // Not bytes.
      return at::zeros({length}, at::kFloat);
    case 2: // Not at offset 0.
      return at::zeros({length + 1}, at::kByte).narrow(0, 1, length);
    case 3: // Not 1-D.
      return at::zeros({2, length}, at::kByte);
    default:
      return at::randint(0, 256, {length}, at::kByte);
  }
}

void mutateTensors(std::vector<at::Tensor>* tensors, std::mt19937_64& rng) {
  switch (rng() % 4) {
    case 0:
      if (!tensors->empty()) {
        tensors->pop_back();
      }
      break;
    case 1:
      tensors->push_back(randomWireTensor(rng));
      break;
    case 2:
      if (!tensors->empty()) {
        (*tensors)[rng() % tensors->size()] = randomWireTensor(rng);
      }
      break;
    default:
      std::shuffle(tensors->begin(), tensors->end(), rng);
      break;
  }
}

size_t maxRssBytes() {
  struct rusage usage;
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<size_t>(usage.ru_maxrss) * 1024;
}

// Mutated bytes make protobuf log every invalid UTF-8 string it refuses.
class QuietProtobuf {
 public:
  QuietProtobuf() : previous_(google::protobuf::SetLogHandler(nullptr)) {}
  ~QuietProtobuf() {
    google::protobuf::SetLogHandler(previous_);
  }

 private:
  google::protobuf::LogHandler* previous_;
};

struct Outcome {
  int unparsable = 0;
  int decoded = 0;
  int refused = 0;
};

// Parses and decodes one message as a receiver would; fails the test on any
// outcome but success or kMalformedMessage.
void receive(
    const std::string& envelopeBytes,
    std::vector<at::Tensor> wireTensors,
    const std::vector<ValueExtension>& extensions,
    Outcome* outcome) {
  wire::Envelope envelope;
  if (!envelope.ParseFromString(envelopeBytes)) {
    ++outcome->unparsable;
    return;
  }
  wire::ListValue body;
  google::protobuf::io::CodedInputStream input(
      reinterpret_cast<const uint8_t*>(envelope.body().data()),
      static_cast<int>(envelope.body().size()));
  input.SetRecursionLimit(4 * kMaxValueDepth);
  if (!body.ParseFromCodedStream(&input)) {
    ++outcome->unparsable;
    return;
  }
  try {
    ValueDecoder decoder(0, envelope, std::move(wireTensors), &extensions);
    std::vector<c10::IValue> values;
    for (const auto& value : body.elements()) {
      values.push_back(decoder.decode(value));
    }
    ++outcome->decoded;
    // Whatever decoded must be sendable again, or refused as bad arguments
    // (say, a tensor that landed on a device with no map entry).
    ValueEncoder encoder(1, nullptr, &extensions);
    wire::ListValue again;
    for (const auto& value : values) {
      try {
        encoder.encode(value, again.add_elements());
      } catch (const RpcError& e) {
        EXPECT_EQ(e.code(), ErrorCode::kBadArguments) << e.what();
      }
    }
  } catch (const RpcError& e) {
    ASSERT_EQ(e.code(), ErrorCode::kMalformedMessage) << e.what();
    ++outcome->refused;
  } catch (const std::exception& e) {
    FAIL() << "decoding threw something other than RpcError: " << e.what();
  }
}

TEST(ValueCodecFuzz, MutatedEnvelopesDecodeOrAreRefused) {
  QuietProtobuf quiet;
  const auto extensions = fuzzExtensions();
  const auto seeds = makeSeeds(extensions);
  std::mt19937_64 rng(fuzzSeed());
  const auto start = std::chrono::steady_clock::now();
  Outcome outcome;
  int iterations = 0;
  for (; iterations < kMutatedEnvelopes; ++iterations) {
    if (std::chrono::steady_clock::now() - start > kTimeBudget) {
      break;
    }
    const Seed& seed = seeds[rng() % seeds.size()];
    std::string bytes = seed.envelopeBytes;
    std::vector<at::Tensor> tensors = seed.wireTensors;
    const auto choice = rng() % 8;
    if (choice < 3) {
      mutateBytes(&bytes, rng);
    } else if (choice < 6) {
      // The body is nested bytes: mutate it so that the envelope still
      // parses and the values are what breaks.
      wire::Envelope envelope;
      ASSERT_TRUE(envelope.ParseFromString(bytes));
      mutateBytes(envelope.mutable_body(), rng);
      if (rng() % 2) {
        std::string descs;
        wire::Envelope onlyDescs;
        *onlyDescs.mutable_tensors() = envelope.tensors();
        onlyDescs.SerializeToString(&descs);
        mutateBytes(&descs, rng);
        envelope.clear_tensors();
        wire::Envelope parsed;
        if (parsed.ParseFromString(descs)) {
          *envelope.mutable_tensors() = parsed.tensors();
        }
      }
      envelope.SerializeToString(&bytes);
    } else {
      mutateTensors(&tensors, rng);
      if (rng() % 2) {
        mutateBytes(&bytes, rng);
      }
    }
    ASSERT_NO_FATAL_FAILURE(
        receive(bytes, std::move(tensors), extensions, &outcome));
  }
  std::cout << "fuzzed " << iterations << " messages in "
            << std::chrono::duration_cast<std::chrono::milliseconds>(
                   std::chrono::steady_clock::now() - start)
                   .count()
            << " ms: " << outcome.decoded << " decoded, " << outcome.refused
            << " refused, " << outcome.unparsable << " unparsable" << std::endl;
  EXPECT_GT(outcome.decoded, 0);
  EXPECT_GT(outcome.refused, 0);
  std::cout << "max RSS " << (maxRssBytes() >> 20) << " MiB" << std::endl;
  EXPECT_LT(maxRssBytes(), size_t(2) << 30);
}

// Random descriptors over random byte tensors: the sizes, dtypes and devices
// a peer could claim, including absurd ones.
TEST(ValueCodecFuzz, RandomTensorDescriptorsDecodeOrAreRefused) {
  QuietProtobuf quiet;
  const auto extensions = fuzzExtensions();
  std::mt19937_64 rng(fuzzSeed() + 1);
  static const int64_t interestingSizes[] = {
      0,
      1,
      2,
      3,
      -1,
      int64_t(1) << 31,
      int64_t(1) << 40,
      int64_t(1) << 62,
      std::numeric_limits<int64_t>::max(),
      std::numeric_limits<int64_t>::min()};
  const auto start = std::chrono::steady_clock::now();
  Outcome outcome;
  int iterations = 0;
  for (; iterations < kDescriptorSets; ++iterations) {
    if (std::chrono::steady_clock::now() - start > kTimeBudget / 3) {
      break;
    }
    wire::Envelope envelope;
    wire::ListValue body;
    std::vector<at::Tensor> tensors;
    const int count = static_cast<int>(rng() % 4);
    for (int i = 0; i < count; ++i) {
      auto* desc = envelope.add_tensors();
      desc->set_dtype(static_cast<uint32_t>(rng() % 20));
      const int dims = static_cast<int>(rng() % 5);
      int64_t numel = 1;
      for (int d = 0; d < dims; ++d) {
        int64_t size = rng() % 3 == 0
            ? interestingSizes[rng() % std::size(interestingSizes)]
            : static_cast<int64_t>(rng() % 5);
        desc->add_sizes(size);
        numel *= (size >= 0 && size < 8) ? size : 1;
      }
      desc->set_requires_grad(rng() % 4 == 0);
      if (rng() % 6 == 0) {
        desc->set_device_type(static_cast<int32_t>(rng() % 24) - 2);
        desc->set_device_index(static_cast<int32_t>(rng() % 5) - 2);
      }
      // Usually the right byte count for the claimed dtype, sometimes not.
      int64_t itemSize = desc->dtype() < 13
          ? static_cast<int64_t>(
                c10::elementSize(static_cast<c10::ScalarType>(desc->dtype())))
          : 1;
      int64_t length = numel * itemSize + (rng() % 4 == 0 ? rng() % 3 : 0);
      tensors.push_back(
          rng() % 8 == 0 ? randomWireTensor(rng)
                         : at::randint(0, 256, {length}, at::kByte));
      body.add_elements()->set_tensor_index(
          static_cast<uint32_t>(rng() % (count + 1)));
    }
    body.SerializeToString(envelope.mutable_body());
    std::string bytes;
    envelope.SerializeToString(&bytes);
    ASSERT_NO_FATAL_FAILURE(
        receive(bytes, std::move(tensors), extensions, &outcome));
  }
  std::cout << "fuzzed " << iterations
            << " descriptor sets: " << outcome.decoded << " decoded, "
            << outcome.refused << " refused" << std::endl;
  EXPECT_GT(outcome.decoded, 0);
  EXPECT_GT(outcome.refused, 0);
}

// Random value trees, built field by field: every kind, type descriptor and
// nesting a peer could write.
void randomType(wire::TypeDesc* type, std::mt19937_64& rng, int depth) {
  type->set_kind(static_cast<wire::TypeDesc::Kind>(rng() % 16));
  if (depth > 6) {
    return;
  }
  int args = 0;
  switch (type->kind()) {
    case wire::TypeDesc::OPTIONAL:
    case wire::TypeDesc::LIST:
      args = 1;
      break;
    case wire::TypeDesc::DICT:
      args = 2;
      break;
    case wire::TypeDesc::TUPLE:
      args = static_cast<int>(rng() % 3);
      break;
    default:
      break;
  }
  if (rng() % 10 == 0) {
    args = static_cast<int>(rng() % 3);
  }
  for (int i = 0; i < args; ++i) {
    randomType(type->add_args(), rng, depth + 1);
  }
}

void randomValue(wire::Value* value, std::mt19937_64& rng, int depth) {
  const int kind =
      depth > 5 ? static_cast<int>(rng() % 7) : static_cast<int>(rng() % 13);
  switch (kind) {
    case 0:
      value->mutable_none();
      break;
    case 1:
      value->set_bool_value(rng() % 2);
      break;
    case 2:
      value->set_int_value(static_cast<int64_t>(rng()));
      break;
    case 3:
      value->set_double_value(static_cast<double>(rng()) / 7.0);
      break;
    case 4:
      value->set_string_value(std::string(rng() % 4, '\xff'));
      break;
    case 5:
      value->set_tensor_index(static_cast<uint32_t>(rng() % 3));
      break;
    case 6: {
      auto* device = value->mutable_device();
      device->set_type(static_cast<int32_t>(rng() % 24) - 2);
      device->set_index(static_cast<int32_t>(rng() % 300) - 2);
      break;
    }
    case 7: {
      auto* list = value->mutable_list();
      randomType(list->mutable_element_type(), rng, 0);
      for (int i = static_cast<int>(rng() % 4); i > 0; --i) {
        randomValue(list->add_elements(), rng, depth + 1);
      }
      break;
    }
    case 8:
      for (int i = static_cast<int>(rng() % 4); i > 0; --i) {
        randomValue(value->mutable_tuple()->add_elements(), rng, depth + 1);
      }
      break;
    case 9: {
      auto* dict = value->mutable_dict();
      randomType(dict->mutable_key_type(), rng, 0);
      randomType(dict->mutable_value_type(), rng, 0);
      for (int i = static_cast<int>(rng() % 4); i > 0; --i) {
        auto* entry = dict->add_entries();
        randomValue(entry->mutable_key(), rng, depth + 1);
        randomValue(entry->mutable_value(), rng, depth + 1);
      }
      break;
    }
    case 10:
      value->mutable_complex_value()->set_real(1);
      break;
    case 11: {
      auto* extension = value->mutable_extension();
      extension->set_kind(rng() % 4 ? "fuzz.box" : "nope");
      extension->set_payload(rng() % 2 ? "box" : "");
      for (int i = static_cast<int>(rng() % 3); i > 0; --i) {
        randomValue(extension->add_values(), rng, depth + 1);
      }
      break;
    }
    default:
      break; // No kind set.
  }
}

TEST(ValueCodecFuzz, RandomValueTreesDecodeOrAreRefused) {
  QuietProtobuf quiet;
  const auto extensions = fuzzExtensions();
  std::mt19937_64 rng(fuzzSeed() + 2);
  const auto start = std::chrono::steady_clock::now();
  Outcome outcome;
  int iterations = 0;
  for (; iterations < kValueTrees; ++iterations) {
    if (std::chrono::steady_clock::now() - start > kTimeBudget / 3) {
      break;
    }
    wire::Envelope envelope;
    std::vector<at::Tensor> tensors;
    for (auto dtype : {at::kFloat, at::kLong}) {
      auto* desc = envelope.add_tensors();
      desc->set_dtype(static_cast<uint32_t>(dtype));
      desc->add_sizes(16 / static_cast<int64_t>(c10::elementSize(dtype)));
      tensors.push_back(at::zeros({16}, at::kByte));
    }
    wire::ListValue body;
    randomValue(body.add_elements(), rng, 0);
    body.SerializeToString(envelope.mutable_body());
    std::string bytes;
    envelope.SerializeToString(&bytes);
    ASSERT_NO_FATAL_FAILURE(
        receive(bytes, std::move(tensors), extensions, &outcome));
  }
  std::cout << "fuzzed " << iterations << " value trees: " << outcome.decoded
            << " decoded, " << outcome.refused << " refused" << std::endl;
  EXPECT_GT(outcome.decoded, 0);
  EXPECT_GT(outcome.refused, 0);
}

} // namespace
} // namespace detail
} // namespace rpc
} // namespace torchrpc
