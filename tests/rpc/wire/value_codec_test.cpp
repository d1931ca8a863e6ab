#include "torchrpc/rpc/wire/value_codec.h"

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue_inl.h>
#include <ATen/core/jit_type.h>
#include <google/protobuf/io/coded_stream.h>
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "tests/support/wire_tensors.h"
#include "torchrpc/rpc/errors.h"

namespace torchrpc {
namespace rpc {
namespace detail {
namespace {

using harness::asWireTensors;
using harness::wireDtypes;

// The values nest about three protobuf messages per level (Value, DictValue,
// DictEntry), beyond protobuf's default recursion limit of 100.
bool parseDeep(const std::string& bytes, google::protobuf::Message* out) {
  google::protobuf::io::CodedInputStream input(
      reinterpret_cast<const uint8_t*>(bytes.data()),
      static_cast<int>(bytes.size()));
  input.SetRecursionLimit(4 * kMaxValueDepth);
  return out->ParseFromCodedStream(&input) && input.ConsumedEntireMessage();
}

// A message as it travels: an envelope whose body holds the values, and the
// transport's tensors.
struct Message {
  wire::Envelope envelope;
  wire::ListValue values;
  std::vector<at::Tensor> tensors;
};

Message encodeMessage(
    const std::vector<c10::IValue>& values,
    const DeviceMap* deviceMap = nullptr,
    const std::vector<ValueExtension>* extensions = nullptr) {
  ValueEncoder encoder(/*toWorker=*/1, deviceMap, extensions);
  Message message;
  for (const auto& value : values) {
    encoder.encode(value, message.values.add_elements());
  }
  message.tensors = std::move(encoder).finish(&message.envelope);
  return message;
}

// Serializes and parses back, as sender and receiver would.
Message throughWire(const Message& sent) {
  wire::Envelope envelope = sent.envelope;
  EXPECT_TRUE(sent.values.SerializeToString(envelope.mutable_body()));
  std::string bytes;
  EXPECT_TRUE(envelope.SerializeToString(&bytes));
  Message received;
  EXPECT_TRUE(received.envelope.ParseFromString(bytes));
  EXPECT_TRUE(parseDeep(received.envelope.body(), &received.values));
  received.tensors = asWireTensors(sent.tensors);
  return received;
}

std::vector<c10::IValue> decodeMessage(
    const Message& received,
    const std::vector<ValueExtension>* extensions = nullptr) {
  ValueDecoder decoder(
      /*fromWorker=*/0,
      received.envelope,
      received.tensors,
      extensions);
  std::vector<c10::IValue> values;
  for (const auto& value : received.values.elements()) {
    values.push_back(decoder.decode(value));
  }
  return values;
}

std::vector<c10::IValue> roundTrip(
    const std::vector<c10::IValue>& values,
    const std::vector<ValueExtension>* extensions = nullptr) {
  return decodeMessage(
      throughWire(encodeMessage(values, nullptr, extensions)),
      extensions);
}

c10::IValue roundTrip(const c10::IValue& value) {
  auto values = roundTrip(std::vector<c10::IValue>{value});
  EXPECT_EQ(values.size(), 1u);
  return values.at(0);
}

void expectSameTensor(const at::Tensor& expected, const at::Tensor& actual) {
  ASSERT_TRUE(actual.defined());
  EXPECT_EQ(actual.scalar_type(), expected.scalar_type());
  EXPECT_EQ(actual.sizes(), expected.sizes());
  EXPECT_EQ(actual.requires_grad(), expected.requires_grad());
  EXPECT_TRUE(actual.device().is_cpu());
  EXPECT_TRUE(actual.is_contiguous());
  EXPECT_TRUE(at::equal(actual.detach(), expected.detach()))
      << "expected " << expected << "\nactual " << actual;
}

// Kind, container types and contents, recursively.
void expectSameValue(const c10::IValue& expected, const c10::IValue& actual) {
  ASSERT_EQ(actual.tagKind(), expected.tagKind());
  if (expected.isTensor()) {
    expectSameTensor(expected.toTensor(), actual.toTensor());
  } else if (expected.isList()) {
    auto e = expected.toList();
    auto a = actual.toList();
    EXPECT_EQ(*a.elementType(), *e.elementType())
        << a.elementType()->annotation_str() << " vs "
        << e.elementType()->annotation_str();
    ASSERT_EQ(a.size(), e.size());
    for (size_t i = 0; i < e.size(); ++i) {
      expectSameValue(e.get(i), a.get(i));
    }
  } else if (expected.isTuple()) {
    const auto& e = expected.toTupleRef().elements();
    const auto& a = actual.toTupleRef().elements();
    ASSERT_EQ(a.size(), e.size());
    for (size_t i = 0; i < e.size(); ++i) {
      expectSameValue(e[i], a[i]);
    }
  } else if (expected.isGenericDict()) {
    auto e = expected.toGenericDict();
    auto a = actual.toGenericDict();
    EXPECT_EQ(*a.keyType(), *e.keyType());
    EXPECT_EQ(*a.valueType(), *e.valueType());
    ASSERT_EQ(a.size(), e.size());
    auto ai = a.begin();
    for (auto ei = e.begin(); ei != e.end(); ++ei, ++ai) {
      expectSameValue(ei->key(), ai->key());
      expectSameValue(ei->value(), ai->value());
    }
  } else if (expected.isDouble()) {
    // Bit-exact, so that -0.0 and NaN count too.
    double e = expected.toDouble();
    double a = actual.toDouble();
    EXPECT_EQ(std::memcmp(&e, &a, sizeof(double)), 0) << e << " vs " << a;
  } else {
    EXPECT_EQ(actual, expected);
  }
}

void expectRoundTrip(const c10::IValue& value) {
  SCOPED_TRACE(value.tagKind());
  expectSameValue(value, roundTrip(value));
}

template <typename F>
void expectRpcError(F&& f, ErrorCode code, const std::string& substring) {
  try {
    f();
    ADD_FAILURE() << "expected an RpcError containing '" << substring << "'";
  } catch (const RpcError& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_NE(e.detail().find(substring), std::string::npos)
        << "'" << e.detail() << "' lacks '" << substring << "'";
    EXPECT_EQ(e.worker(), "");
    EXPECT_EQ(e.function(), "");
    EXPECT_EQ(e.messageId(), 0u);
  }
}

void expectMalformed(const Message& received, const std::string& substring) {
  expectRpcError(
      [&]() { decodeMessage(received); },
      ErrorCode::kMalformedMessage,
      substring);
}

void expectEncodeRefused(const c10::IValue& value, const std::string& what) {
  expectRpcError(
      [&]() { encodeMessage({value}); },
      ErrorCode::kBadArguments,
      what);
}

c10::IValue nestedLists(int levels, c10::IValue inner) {
  for (int i = 0; i < levels; ++i) {
    c10::impl::GenericList list(c10::unshapedType(inner.type()));
    list.push_back(std::move(inner));
    inner = c10::IValue(std::move(list));
  }
  return inner;
}

at::Tensor sampleTensor(at::ScalarType dtype) {
  auto values = at::arange(-11, 13, at::kDouble).reshape({2, 3, 4});
  if (dtype == at::kBool) {
    return (values.remainder(3) == 0);
  }
  if (at::isComplexType(dtype)) {
    return at::complex(values, values * 0.5).to(dtype);
  }
  if (at::isFloatingType(dtype)) {
    return (values * 0.25).to(dtype);
  }
  if (dtype == at::kByte) {
    return (values + 11).to(dtype);
  }
  return values.to(dtype);
}

TEST(ValueCodec, ScalarsRoundTrip) {
  expectRoundTrip(c10::IValue());
  expectRoundTrip(true);
  expectRoundTrip(false);
  expectRoundTrip(int64_t(0));
  expectRoundTrip(std::numeric_limits<int64_t>::min());
  expectRoundTrip(std::numeric_limits<int64_t>::max());
  expectRoundTrip(3.25);
  expectRoundTrip(-0.0);
  expectRoundTrip(std::numeric_limits<double>::infinity());
  expectRoundTrip(std::numeric_limits<double>::quiet_NaN());
  expectRoundTrip(c10::complex<double>(1.5, -2.5));
  expectRoundTrip(std::string());
  expectRoundTrip(std::string("hello"));
  expectRoundTrip(c10::Device(c10::kCPU));
  expectRoundTrip(c10::Device(c10::kCUDA, 1));
  expectRoundTrip(c10::Device(c10::kMeta));
}

TEST(ValueCodec, StringsMayHoldAnyBytes) {
  std::string bytes("\xff\xfe\0\x80z", 5);
  auto decoded = roundTrip(c10::IValue(bytes));
  EXPECT_EQ(decoded.toStringRef(), bytes);
}

TEST(ValueCodec, TensorsOfEveryDtypeRoundTripExactly) {
  for (auto dtype : wireDtypes()) {
    SCOPED_TRACE(c10::toString(dtype));
    auto tensor = sampleTensor(dtype);
    ASSERT_EQ(tensor.scalar_type(), dtype);
    expectRoundTrip(tensor);
    if (at::isFloatingType(dtype) || at::isComplexType(dtype)) {
      expectRoundTrip(tensor.clone().requires_grad_(true));
    }
  }
}

TEST(ValueCodec, ReceivedTensorIsLeafSharingWireBytes) {
  auto tensor = at::randn({4, 5}).requires_grad_(true);
  auto sent = encodeMessage({tensor * 2});
  auto received = throughWire(sent);
  auto wireData = received.tensors.at(0).data_ptr();
  auto values = decodeMessage(received);
  auto decoded = values.at(0).toTensor();
  EXPECT_EQ(decoded.data_ptr(), wireData);
  EXPECT_TRUE(decoded.requires_grad());
  EXPECT_TRUE(decoded.is_leaf());
  EXPECT_TRUE(at::equal(decoded.detach(), (tensor * 2).detach()));
}

// The decoder builds the received tensor's TensorImpl itself (no
// dispatcher call): it must be what at::empty() and set_() made before.
TEST(ValueCodec, ReceivedTensorIsAnOrdinaryCpuTensor) {
  auto tensor = at::arange(24, at::kDouble).reshape({2, 3, 4});
  auto received = throughWire(encodeMessage({tensor, tensor.sum()}));
  auto wireStorage = received.tensors.at(0).storage();
  auto values = decodeMessage(received);
  auto decoded = values.at(0).toTensor();
  auto scalar = values.at(1).toTensor();
  auto reference = at::empty({2, 3, 4}, at::kDouble);
  EXPECT_EQ(decoded.key_set(), reference.key_set());
  EXPECT_EQ(decoded.sizes(), reference.sizes());
  EXPECT_EQ(decoded.strides(), reference.strides());
  EXPECT_TRUE(decoded.is_contiguous());
  EXPECT_TRUE(decoded.storage().is_alias_of(wireStorage));
  EXPECT_EQ(decoded.storage_offset(), 0);
  EXPECT_EQ(scalar.dim(), 0);
  EXPECT_EQ(scalar.item<double>(), 276.0);
  EXPECT_TRUE(at::equal(decoded, tensor));

  // Autograd and in-place updates work on it as on any leaf.
  auto leaf = decoded.requires_grad_(true);
  (leaf * leaf).sum().backward();
  EXPECT_TRUE(at::equal(leaf.grad(), tensor * 2));
  auto version = decoded.detach()._version();
  decoded.detach().add_(1);
  EXPECT_EQ(decoded.detach()._version(), version + 1);
  EXPECT_TRUE(at::equal(decoded.detach(), tensor + 1));
}

TEST(ValueCodec, SentTensorIsDetached) {
  auto tensor = at::randn({3}).requires_grad_(true);
  auto sent = encodeMessage({tensor});
  EXPECT_FALSE(sent.tensors.at(0).requires_grad());
  EXPECT_TRUE(sent.envelope.tensors(0).requires_grad());
}

TEST(ValueCodec, OriginalTensorsAreTheCallersInWireOrder) {
  auto first = at::randn({2, 3}).requires_grad_(true);
  auto second = at::arange(6).reshape({2, 3}).t();
  ValueEncoder encoder(1, nullptr, nullptr);
  wire::Value value;
  encoder.encode(c10::ivalue::Tuple::create({first, 1.0, second}), &value);
  ASSERT_EQ(encoder.originalTensors().size(), 2u);
  EXPECT_TRUE(encoder.originalTensors()[0].is_same(first));
  EXPECT_TRUE(encoder.originalTensors()[1].is_same(second));
  wire::Envelope envelope;
  auto tensors = std::move(encoder).finish(&envelope);
  EXPECT_FALSE(tensors[1].is_same(second));
  EXPECT_TRUE(tensors[1].is_contiguous());
}

TEST(ValueCodec, NonContiguousTensorArrivesContiguous) {
  auto base = at::arange(12, at::kFloat).reshape({3, 4});
  auto transposed = base.t();
  ASSERT_FALSE(transposed.is_contiguous());
  auto sent = encodeMessage({transposed});
  EXPECT_TRUE(sent.tensors.at(0).is_contiguous());
  EXPECT_EQ(sent.tensors.at(0).nbytes(), 12 * sizeof(float));
  auto decoded = decodeMessage(throughWire(sent)).at(0).toTensor();
  EXPECT_TRUE(decoded.is_contiguous());
  expectSameTensor(transposed, decoded);

  auto strided = at::arange(20, at::kLong).slice(0, 0, 20, 3);
  expectRoundTrip(strided);
}

TEST(ValueCodec, ContiguousViewSendsOnlyItsBytes) {
  auto base = at::arange(100, at::kLong);
  auto narrow = base.narrow(0, 10, 20);
  auto sent = encodeMessage({narrow});
  ASSERT_EQ(sent.tensors.size(), 1u);
  EXPECT_EQ(sent.tensors[0].nbytes(), 20 * sizeof(int64_t));
  // No copy: the transport reads straight from the caller's storage.
  EXPECT_EQ(sent.tensors[0].data_ptr(), narrow.data_ptr());
  expectSameTensor(narrow, decodeMessage(throughWire(sent)).at(0).toTensor());

  auto matrix = at::arange(30, at::kFloat).reshape({5, 6});
  auto row = matrix.select(0, 3);
  sent = encodeMessage({row});
  EXPECT_EQ(sent.tensors[0].nbytes(), 6 * sizeof(float));
  EXPECT_EQ(sent.tensors[0].data_ptr(), row.data_ptr());
  expectSameTensor(row, decodeMessage(throughWire(sent)).at(0).toTensor());
}

TEST(ValueCodec, ZeroSizeTensorsRoundTrip) {
  expectRoundTrip(at::empty({0}, at::kFloat));
  expectRoundTrip(at::empty({3, 0, 2}, at::kLong));
  expectRoundTrip(at::empty({0}, at::kDouble).requires_grad_(true));
  expectRoundTrip(at::scalar_tensor(7.5, at::kDouble));
  auto sent = encodeMessage({at::empty({4, 0}, at::kInt)});
  EXPECT_EQ(sent.tensors.at(0).nbytes(), 0u);
}

TEST(ValueCodec, LazyConjugateAndNegativeAreResolved) {
  auto complex = sampleTensor(at::kComplexFloat);
  auto conj = complex.conj();
  ASSERT_TRUE(conj.is_conj());
  auto decoded = roundTrip(c10::IValue(conj)).toTensor();
  EXPECT_FALSE(decoded.is_conj());
  EXPECT_TRUE(at::equal(decoded, conj.resolve_conj()));

  auto neg = at::_neg_view(sampleTensor(at::kFloat));
  ASSERT_TRUE(neg.is_neg());
  decoded = roundTrip(c10::IValue(neg)).toTensor();
  EXPECT_TRUE(at::equal(decoded, neg.resolve_neg()));
}

TEST(ValueCodec, SameTensorTwiceRoundTrips) {
  auto tensor = at::randn({2, 2});
  auto values = roundTrip({tensor, tensor});
  expectSameTensor(tensor, values.at(0).toTensor());
  expectSameTensor(tensor, values.at(1).toTensor());
}

TEST(ValueCodec, TypedListsKeepTheirTypes) {
  expectRoundTrip(c10::List<int64_t>());
  expectRoundTrip(c10::List<int64_t>({1, -2, 3}));
  expectRoundTrip(c10::List<double>({1.5}));
  expectRoundTrip(c10::List<bool>({true, false}));
  expectRoundTrip(c10::List<std::string>({"a", ""}));
  expectRoundTrip(c10::List<at::Tensor>());
  expectRoundTrip(c10::List<at::Tensor>({at::ones({2}), at::zeros({1, 1})}));
  expectRoundTrip(c10::List<c10::optional<at::Tensor>>());
  expectRoundTrip(c10::List<c10::optional<at::Tensor>>(
      {c10::nullopt, at::ones({2}), c10::nullopt}));
  expectRoundTrip(c10::List<c10::List<double>>());
  expectRoundTrip(c10::List<c10::List<int64_t>>(
      {c10::List<int64_t>(), c10::List<int64_t>({4})}));

  auto decoded = roundTrip(c10::IValue(c10::List<int64_t>()));
  EXPECT_EQ(decoded.toList().elementType()->annotation_str(), "int");
  decoded = roundTrip(
      c10::IValue(c10::List<c10::optional<at::Tensor>>({c10::nullopt})));
  EXPECT_EQ(
      decoded.toList().elementType()->annotation_str(),
      "Optional[Tensor]");

  // Element types the wire has a name for, including tuple, number, any.
  auto tupleType =
      c10::TupleType::create({c10::IntType::get(), c10::TensorType::get()});
  c10::impl::GenericList tuples(tupleType);
  tuples.push_back(c10::ivalue::Tuple::create({int64_t(1), at::ones({1})}));
  expectRoundTrip(tuples);
  c10::impl::GenericList numbers(c10::NumberType::get());
  numbers.push_back(int64_t(1));
  numbers.push_back(2.5);
  numbers.push_back(c10::complex<double>(0, 1));
  expectRoundTrip(numbers);
  c10::impl::GenericList anything(c10::AnyType::get());
  anything.push_back(c10::IValue());
  anything.push_back(std::string("x"));
  anything.push_back(at::ones({1}));
  expectRoundTrip(anything);
  expectRoundTrip(c10::impl::GenericList(c10::DeviceObjType::get()));
  expectRoundTrip(c10::impl::GenericList(c10::ComplexType::get()));
  expectRoundTrip(c10::impl::GenericList(c10::NoneType::get()));
  expectRoundTrip(c10::impl::GenericList(c10::DictType::create(
      c10::StringType::get(),
      c10::ListType::ofTensors())));
}

TEST(ValueCodec, UnnamedElementTypeBecomesAny) {
  auto unionType =
      c10::UnionType::create({c10::IntType::get(), c10::StringType::get()});
  c10::impl::GenericList list(unionType);
  list.push_back(int64_t(1));
  list.push_back(std::string("a"));
  auto decoded = roundTrip(c10::IValue(list));
  EXPECT_EQ(*decoded.toList().elementType(), *c10::AnyType::get());
  EXPECT_EQ(decoded.toList().get(1).toStringRef(), "a");
}

TEST(ValueCodec, TuplesRoundTrip) {
  expectRoundTrip(c10::ivalue::Tuple::create({}));
  expectRoundTrip(c10::ivalue::Tuple::create(
      {int64_t(1),
       std::string("two"),
       at::ones({3}),
       c10::IValue(),
       c10::ivalue::Tuple::create({2.5})}));
}

TEST(ValueCodec, DictsKeepTheirTypes) {
  c10::Dict<std::string, at::Tensor> named;
  named.insert("weight", at::randn({2, 3}));
  named.insert("bias", at::randn({3}));
  expectRoundTrip(named);
  expectRoundTrip(c10::Dict<int64_t, c10::List<int64_t>>());
  c10::Dict<int64_t, c10::List<int64_t>> lists;
  lists.insert(3, c10::List<int64_t>({1}));
  lists.insert(-1, c10::List<int64_t>());
  expectRoundTrip(lists);
  c10::Dict<bool, double> flags;
  flags.insert(true, 1.0);
  flags.insert(false, 0.0);
  expectRoundTrip(flags);
  c10::Dict<double, std::string> byFloat;
  byFloat.insert(0.5, "half");
  expectRoundTrip(byFloat);

  auto decoded = roundTrip(c10::IValue(c10::Dict<std::string, int64_t>()));
  EXPECT_EQ(decoded.type()->annotation_str(), "Dict[str, int]");
}

TEST(ValueCodec, DictWithTensorKeysIsRefused) {
  c10::impl::GenericDict dict(c10::TensorType::get(), c10::IntType::get());
  dict.insert(at::ones({1}), int64_t(1));
  expectEncodeRefused(dict, "keys of type Tensor");
}

TEST(ValueCodec, NestedCombinationsRoundTrip) {
  auto anyDict =
      c10::DictType::create(c10::StringType::get(), c10::AnyType::get());
  c10::impl::GenericDict inner(c10::StringType::get(), c10::AnyType::get());
  inner.insert(
      std::string("tensors"),
      c10::List<at::Tensor>({at::ones({2}), at::eye(2)}));
  inner.insert(
      std::string("pair"),
      c10::ivalue::Tuple::create({at::zeros({0}), int64_t(5)}));
  inner.insert(std::string("nothing"), c10::IValue());
  c10::impl::GenericList outer(anyDict);
  outer.push_back(inner);
  outer.push_back(
      c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get()));
  auto value = c10::ivalue::Tuple::create(
      {outer,
       c10::complex<double>(1, 2),
       c10::Device(c10::kCPU),
       c10::List<c10::List<at::Tensor>>(
           {c10::List<at::Tensor>({at::randn({2, 2}).t()})})});
  auto values = roundTrip({value, at::arange(3), value});
  expectSameValue(value, values.at(0));
  expectSameValue(value, values.at(2));
}

TEST(ValueCodec, DepthUpToTheCapRoundTrips) {
  // kMaxValueDepth levels in all: the innermost int is the last.
  expectRoundTrip(nestedLists(kMaxValueDepth - 1, int64_t(7)));

  c10::IValue dicts = at::ones({1});
  for (int i = 0; i < kMaxValueDepth - 1; ++i) {
    c10::impl::GenericDict dict(
        c10::StringType::get(),
        c10::unshapedType(dicts.type()));
    dict.insert(std::string("k"), std::move(dicts));
    dicts = c10::IValue(std::move(dict));
  }
  expectRoundTrip(dicts);
}

TEST(ValueCodec, DepthBeyondTheCapIsRefused) {
  expectEncodeRefused(
      nestedLists(kMaxValueDepth, int64_t(7)),
      "nested deeper than 64");

  // A peer that nests deeper anyway.
  wire::Value deep;
  deep.set_int_value(1);
  for (int i = 0; i < kMaxValueDepth; ++i) {
    wire::Value outer;
    *outer.mutable_tuple()->add_elements() = std::move(deep);
    deep = std::move(outer);
  }
  Message received;
  *received.values.add_elements() = deep;
  expectMalformed(received, "nested deeper than 64");

  wire::TypeDesc type;
  for (int i = 0; i < 2 * kMaxValueDepth; ++i) {
    wire::TypeDesc outer;
    outer.set_kind(wire::TypeDesc::LIST);
    *outer.add_args() = std::move(type);
    type = std::move(outer);
  }
  received.values.Clear();
  *received.values.add_elements()->mutable_list()->mutable_element_type() =
      type;
  expectMalformed(received, "nested deeper than 64");
}

// Stands in for an upper layer's kind (an RRef): a completed future travels
// as its value.
std::vector<ValueExtension> futureExtension() {
  ValueExtension extension;
  extension.kind = "test.future";
  extension.matches = [](const c10::IValue& value) { return value.isFuture(); };
  extension.encode = [](const c10::IValue& value,
                        int64_t toWorker,
                        std::string* payload,
                        std::vector<c10::IValue>* nested) {
    EXPECT_EQ(toWorker, 1);
    *payload = std::string("fut\0ure", 7);
    nested->push_back(value.toFuture()->value());
    nested->push_back(at::ones({2}));
  };
  extension.decode = [](int64_t fromWorker,
                        const std::string& payload,
                        std::vector<c10::IValue>&& nested) {
    EXPECT_EQ(fromWorker, 0);
    if (payload != std::string("fut\0ure", 7) || nested.size() != 2) {
      throw std::runtime_error("bad future payload");
    }
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
    future->markCompleted(nested[0]);
    return c10::IValue(future);
  };
  return {extension};
}

c10::IValue completedFuture(c10::IValue value) {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  future->markCompleted(std::move(value));
  return c10::IValue(future);
}

TEST(ValueCodec, ExtensionRoundTrips) {
  auto extensions = futureExtension();
  auto tensor = at::randn({3});
  c10::impl::GenericList list(c10::AnyType::get());
  list.push_back(completedFuture(tensor));
  list.push_back(int64_t(4));

  auto sent = encodeMessage({list}, nullptr, &extensions);
  // The nested tensors travel out of band.
  EXPECT_EQ(sent.tensors.size(), 2u);
  auto values = decodeMessage(throughWire(sent), &extensions);
  auto decoded = values.at(0).toList();
  ASSERT_EQ(decoded.size(), 2u);
  ASSERT_TRUE(decoded.get(0).isFuture());
  expectSameTensor(tensor, decoded.get(0).toFuture()->value().toTensor());
  EXPECT_EQ(decoded.get(1).toInt(), 4);
}

TEST(ValueCodec, UnknownExtensionKindIsMalformed) {
  auto extensions = futureExtension();
  auto sent =
      encodeMessage({completedFuture(int64_t(1))}, nullptr, &extensions);
  expectMalformed(throughWire(sent), "unknown extension kind 'test.future'");
}

TEST(ValueCodec, ExtensionDecodeFailureIsMalformed) {
  auto extensions = futureExtension();
  auto received =
      throughWire(encodeMessage({completedFuture(1.0)}, nullptr, &extensions));
  received.values.mutable_elements(0)->mutable_extension()->set_payload("x");
  expectRpcError(
      [&]() { decodeMessage(received, &extensions); },
      ErrorCode::kMalformedMessage,
      "bad future payload");
}

TEST(ValueCodec, UnsupportedValuesAreRefused) {
  expectEncodeRefused(
      completedFuture(1.0),
      "cannot send a value of type Future");
  c10::impl::GenericList list(c10::AnyType::get());
  list.push_back(completedFuture(1.0));
  expectEncodeRefused(list, "cannot send a value of type Future");
  expectEncodeRefused(
      c10::IValue(at::Generator()),
      "cannot send a value of type");
  expectEncodeRefused(
      at::quantize_per_tensor(at::ones({2}), 0.1, 0, at::kQUInt8),
      "dtype QUInt8");
  expectEncodeRefused(at::ones({2, 2}).to_sparse_csr(), "layout SparseCsr");
  expectEncodeRefused(at::Tensor(), "undefined tensor");
}

TEST(ValueCodec, MistypedListElementIsRefusedOnEncode) {
  c10::impl::GenericList list(c10::IntType::get());
  list.push_back(std::string("not an int"));
  expectEncodeRefused(list, "List[int] holds a value of type String");
}

TEST(ValueCodec, DeviceMapChoosesTheTargetDevice) {
  DeviceMap map;
  map.emplace(c10::Device(c10::kCPU), c10::Device(c10::kCUDA, 0));
  auto sent = encodeMessage({at::ones({2})}, &map);
  ASSERT_EQ(sent.envelope.tensors_size(), 1);
  EXPECT_EQ(
      sent.envelope.tensors(0).device_type(),
      static_cast<int32_t>(c10::DeviceType::CUDA));
  EXPECT_EQ(sent.envelope.tensors(0).device_index(), 0);

  // This worker has no CUDA: the tensor cannot land where it is meant to.
  expectMalformed(throughWire(sent), "device cuda:0");

  sent = encodeMessage({at::ones({2})});
  EXPECT_EQ(sent.envelope.tensors(0).device_type(), 0);
}

TEST(ValueCodec, DeviceWithoutMapEntryIsRefused) {
  expectEncodeRefused(at::empty({2}, at::device(c10::kMeta)), "device meta");
  DeviceMap map;
  map.emplace(c10::Device(c10::kCUDA, 1), c10::Device(c10::kCUDA, 0));
  expectRpcError(
      [&]() { encodeMessage({at::empty({2}, at::device(c10::kMeta))}, &map); },
      ErrorCode::kBadArguments,
      "device map has no entry");
}

// Malformed input. Each case starts from a valid message and breaks one
// thing.

Message validMessage() {
  return throughWire(encodeMessage(
      {at::arange(6, at::kFloat).reshape({2, 3}),
       at::ones({3}, at::kLong),
       at::zeros({2}, at::kByte)}));
}

TEST(ValueCodecMalformed, TensorIndexOutOfRange) {
  auto received = validMessage();
  received.values.mutable_elements(0)->set_tensor_index(7);
  expectMalformed(received, "tensor index 7 out of range (3 tensors)");
}

TEST(ValueCodecMalformed, TensorCountMismatch) {
  auto received = validMessage();
  received.tensors.pop_back();
  expectMalformed(received, "describes 3 tensors but 2 arrived");
}

TEST(ValueCodecMalformed, ByteCountMismatch) {
  auto received = validMessage();
  received.envelope.mutable_tensors(0)->set_sizes(1, 4);
  expectMalformed(received, "needs 32 bytes but 24 arrived");
  received = validMessage();
  received.tensors[1] = received.tensors[1].narrow(0, 0, 8).clone();
  // The error names the tensor (its name is built only on failure).
  expectMalformed(
      received,
      "tensor 1: descriptor needs 24 bytes but 8 arrived");
}

TEST(ValueCodecMalformed, OverflowingSizes) {
  auto received = validMessage();
  auto* desc = received.envelope.mutable_tensors(0);
  desc->clear_sizes();
  desc->add_sizes(int64_t(1) << 40);
  desc->add_sizes(int64_t(1) << 40);
  expectMalformed(received, "sizes overflow");

  // Zero elements, but strides would still overflow.
  desc->clear_sizes();
  desc->add_sizes(0);
  desc->add_sizes(int64_t(1) << 62);
  desc->add_sizes(int64_t(1) << 62);
  expectMalformed(received, "sizes overflow");

  // Fits in elements, not in bytes.
  desc->clear_sizes();
  desc->add_sizes(int64_t(1) << 62);
  expectMalformed(received, "sizes overflow");
}

TEST(ValueCodecMalformed, NegativeSize) {
  auto received = validMessage();
  received.envelope.mutable_tensors(0)->set_sizes(0, -2);
  expectMalformed(received, "negative size -2");
}

TEST(ValueCodecMalformed, BadDtype) {
  auto received = validMessage();
  received.envelope.mutable_tensors(0)->set_dtype(99);
  expectMalformed(received, "dtype 99 not allowed");
  received.envelope.mutable_tensors(0)->set_dtype(
      static_cast<uint32_t>(at::kQInt8));
  expectMalformed(received, "not allowed");
}

TEST(ValueCodecMalformed, RequiresGradOnIntegers) {
  auto received = validMessage();
  received.envelope.mutable_tensors(1)->set_requires_grad(true);
  expectMalformed(received, "requires_grad set on dtype Long");
}

TEST(ValueCodecMalformed, WireTensorNotAsTransportDelivers) {
  auto received = validMessage();
  received.tensors[0] = at::zeros({6}, at::kFloat);
  expectMalformed(received, "expected a contiguous 1-D CPU byte tensor");
  received = validMessage();
  received.tensors[0] = at::zeros({25}, at::kByte).narrow(0, 1, 24);
  expectMalformed(received, "offset 0");
  received = validMessage();
  received.tensors[0] = at::zeros({4, 6}, at::kByte);
  expectMalformed(received, "1-D");
  received = validMessage();
  received.tensors[0] = at::Tensor();
  expectMalformed(received, "undefined");
}

TEST(ValueCodecMalformed, BadTensorDevice) {
  auto received = validMessage();
  received.envelope.mutable_tensors(0)->set_device_type(1000);
  expectMalformed(received, "invalid device type 1000");
  received = validMessage();
  received.envelope.mutable_tensors(0)->set_device_type(
      static_cast<int32_t>(c10::DeviceType::CUDA));
  received.envelope.mutable_tensors(0)->set_device_index(500);
  expectMalformed(received, "invalid device index 500");
}

TEST(ValueCodecMalformed, ListElementNotOfDeclaredType) {
  auto received = throughWire(encodeMessage({c10::List<int64_t>({1, 2})}));
  received.values.mutable_elements(0)
      ->mutable_list()
      ->mutable_elements(1)
      ->set_string_value("two");
  expectMalformed(received, "List[int] holds a value of type String");

  received = throughWire(encodeMessage({c10::List<at::Tensor>()}));
  received.values.mutable_elements(0)
      ->mutable_list()
      ->add_elements()
      ->mutable_none();
  expectMalformed(received, "List[Tensor] holds a value of type None");
}

TEST(ValueCodecMalformed, DictEntriesNotOfDeclaredTypes) {
  c10::Dict<std::string, int64_t> dict;
  dict.insert("a", 1);
  auto received = throughWire(encodeMessage({dict}));
  auto* entry =
      received.values.mutable_elements(0)->mutable_dict()->mutable_entries(0);
  entry->mutable_key()->set_int_value(3);
  expectMalformed(received, "Dict[str, int] holds an entry of types Int, Int");

  received = throughWire(encodeMessage({dict}));
  auto* wireDict = received.values.mutable_elements(0)->mutable_dict();
  *wireDict->add_entries() = wireDict->entries(0);
  expectMalformed(received, "duplicate key");

  received = throughWire(encodeMessage({dict}));
  received.values.mutable_elements(0)
      ->mutable_dict()
      ->mutable_key_type()
      ->set_kind(wire::TypeDesc::TENSOR);
  expectMalformed(received, "dict key type Tensor not allowed");
}

TEST(ValueCodecMalformed, BadTypeDescriptors) {
  auto received = throughWire(encodeMessage({c10::List<int64_t>()}));
  auto* type = received.values.mutable_elements(0)
                   ->mutable_list()
                   ->mutable_element_type();
  type->set_kind(static_cast<wire::TypeDesc::Kind>(77));
  expectMalformed(received, "unknown type descriptor kind 77");
  type->set_kind(wire::TypeDesc::LIST);
  expectMalformed(received, "has 0 type arguments, expected 1");
  type->set_kind(wire::TypeDesc::OPTIONAL);
  type->add_args()->set_kind(wire::TypeDesc::NONE);
  expectMalformed(received, "Optional[NoneType]");
}

TEST(ValueCodecMalformed, ValueWithoutKind) {
  Message received;
  received.values.add_elements();
  expectMalformed(received, "value has no kind set");
  received.values.Clear();
  received.values.add_elements()->mutable_tuple()->add_elements();
  expectMalformed(received, "value has no kind set");
}

TEST(ValueCodecMalformed, BadDeviceValue) {
  Message received;
  auto* device = received.values.add_elements()->mutable_device();
  device->set_type(-3);
  expectMalformed(received, "invalid device type -3");
  device->set_type(0);
  device->set_index(2);
  expectMalformed(received, "invalid device index 2 for cpu");
}

// Sparse COO tensors. See Note [Sparse tensors on the wire].

void expectSameSparse(const at::Tensor& expected, const at::Tensor& actual) {
  ASSERT_TRUE(actual.defined());
  ASSERT_EQ(actual.layout(), at::kSparse);
  EXPECT_EQ(actual.scalar_type(), expected.scalar_type());
  EXPECT_EQ(actual.sizes(), expected.sizes());
  EXPECT_EQ(actual.sparse_dim(), expected.sparse_dim());
  EXPECT_EQ(actual.dense_dim(), expected.dense_dim());
  EXPECT_EQ(actual.is_coalesced(), expected.is_coalesced());
  EXPECT_EQ(actual.requires_grad(), expected.requires_grad());
  // The same entries in the same order, duplicates included.
  EXPECT_TRUE(at::equal(actual._indices(), expected.detach()._indices()));
  EXPECT_TRUE(at::equal(actual._values(), expected.detach()._values()))
      << "expected " << expected << "\nactual " << actual;
}

// Uncoalesced on purpose: index (0, 1) appears twice, out of order.
at::Tensor sampleSparse(
    at::ScalarType dtype,
    std::vector<int64_t> denseSizes = {}) {
  auto indices = at::tensor({1, 0, 0, 2, 1, 1}, at::kLong).reshape({2, 3});
  std::vector<int64_t> valueSizes{3};
  valueSizes.insert(valueSizes.end(), denseSizes.begin(), denseSizes.end());
  auto values = at::arange(at::prod(at::tensor(valueSizes)).item<int64_t>())
                    .reshape(valueSizes)
                    .to(dtype);
  std::vector<int64_t> sizes{3, 4};
  sizes.insert(sizes.end(), denseSizes.begin(), denseSizes.end());
  return at::sparse_coo_tensor(indices, values, sizes);
}

TEST(ValueCodecSparse, SparseTensorsRoundTripExactly) {
  for (auto dtype : {at::kFloat, at::kDouble, at::kLong, at::kComplexFloat}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto uncoalesced = sampleSparse(dtype);
    ASSERT_FALSE(uncoalesced.is_coalesced());
    expectSameSparse(uncoalesced, roundTrip(uncoalesced).toTensor());
    auto coalesced = uncoalesced.coalesce();
    expectSameSparse(coalesced, roundTrip(coalesced).toTensor());
    auto hybrid = sampleSparse(dtype, {2, 2});
    expectSameSparse(hybrid, roundTrip(hybrid).toTensor());
  }
  auto empty = at::sparse_coo_tensor({5, 5}, at::kFloat);
  expectSameSparse(empty, roundTrip(empty).toTensor());
}

TEST(ValueCodecSparse, RequiresGradArrivesOnALeaf) {
  auto sent = sampleSparse(at::kFloat).requires_grad_(true);
  auto received = roundTrip(sent).toTensor();
  expectSameSparse(sent, received);
  EXPECT_TRUE(received.is_leaf());
}

TEST(ValueCodecSparse, OneDescriptorAndTwoTransportTensorsEach) {
  auto dense = at::ones({2});
  auto sparse = sampleSparse(at::kFloat);
  auto sent = encodeMessage({dense, sparse, dense * 2});
  ASSERT_EQ(sent.envelope.tensors_size(), 3);
  EXPECT_EQ(sent.envelope.tensors(1).layout(), wire::TensorDesc::SPARSE_COO);
  ASSERT_EQ(sent.tensors.size(), 4u);
  EXPECT_TRUE(at::equal(sent.tensors[1], sparse._indices()));
  EXPECT_TRUE(at::equal(sent.tensors[2], sparse._values()));
  EXPECT_EQ(sent.values.elements(2).tensor_index(), 2u);

  auto values = decodeMessage(throughWire(sent));
  ASSERT_EQ(values.size(), 3u);
  expectSameTensor(dense, values[0].toTensor());
  expectSameSparse(sparse, values[1].toTensor());
  expectSameTensor(dense * 2, values[2].toTensor());
}

TEST(ValueCodecSparse, HooksSeeTheSparseTensorAsOne) {
  auto sparse = sampleSparse(at::kFloat).requires_grad_(true);
  auto dense = at::ones({2}, at::requires_grad());
  ValueEncoder encoder(/*toWorker=*/1, nullptr, nullptr);
  wire::ListValue values;
  encoder.encode(sparse, values.add_elements());
  encoder.encode(dense, values.add_elements());
  ASSERT_EQ(encoder.originalTensors().size(), 2u);
  EXPECT_TRUE(encoder.originalTensors()[0].is_same(sparse));
  EXPECT_TRUE(encoder.originalTensors()[1].is_same(dense));

  Message received = throughWire(encodeMessage({sparse, dense}));
  ValueDecoder decoder(0, received.envelope, received.tensors, nullptr);
  ASSERT_EQ(decoder.tensors().size(), 2u);
  EXPECT_EQ(decoder.tensors()[0].layout(), at::kSparse);
}

TEST(ValueCodecSparse, OtherSparseLayoutsAreRefused) {
  expectEncodeRefused(at::ones({2, 2}).to_sparse_csr(), "layout SparseCsr");
}

Message validSparseMessage() {
  return throughWire(encodeMessage({sampleSparse(at::kFloat).coalesce()}));
}

TEST(ValueCodecSparseMalformed, IndexOutOfBounds) {
  auto received = validSparseMessage();
  received.tensors[0].view(at::kLong)[3] = 4; // column 4 of a 3 x 4 tensor
  expectMalformed(received, "for dim 1, size is 4 but found index 4");
  received = validSparseMessage();
  received.tensors[0].view(at::kLong)[0] = -1;
  expectMalformed(received, "found negative index -1 for dim 0");
}

TEST(ValueCodecSparseMalformed, TransportTensorCountMismatch) {
  auto received = validSparseMessage();
  received.tensors.pop_back();
  expectMalformed(
      received,
      "describes 1 tensors in 2 transport tensors but 1 arrived");
}

TEST(ValueCodecSparseMalformed, ShapesThatDoNotFit) {
  auto received = validSparseMessage();
  received.envelope.mutable_tensors(0)->set_sparse_dim(3);
  expectMalformed(received, "sparse_dim 3 and nnz 2 do not fit sizes [3, 4]");
  received = validSparseMessage();
  received.envelope.mutable_tensors(0)->set_nnz(-1);
  expectMalformed(received, "sparse_dim 2 and nnz -1");
  received = validSparseMessage();
  received.envelope.mutable_tensors(0)->set_nnz(4);
  expectMalformed(
      received,
      "tensor 0 (indices): descriptor needs 64 bytes but 32 arrived");
  received = validSparseMessage();
  received.envelope.mutable_tensors(0)->set_sizes(0, -3);
  expectMalformed(received, "tensor 0: invalid sizes [-3, 4]");
  received = validSparseMessage();
  received.envelope.mutable_tensors(0)->set_sizes(
      0,
      std::numeric_limits<int64_t>::max());
  expectMalformed(received, "invalid sizes");
}

TEST(ValueCodecSparseMalformed, UnknownLayout) {
  auto received = validSparseMessage();
  received.envelope.mutable_tensors(0)->set_layout(
      static_cast<wire::TensorDesc::Layout>(7));
  // Seen as a strided tensor's count first: 1 transport tensor expected.
  expectMalformed(received, "but 2 arrived");
  received.tensors.pop_back();
  expectMalformed(received, "tensor 0: unknown layout 7");
}

TEST(ValueCodecSparseMalformed, SparseTensorForADeviceIsRefused) {
  auto received = validSparseMessage();
  received.envelope.mutable_tensors(0)->set_device_type(
      static_cast<int32_t>(c10::DeviceType::CUDA));
  expectMalformed(received, "a sparse tensor must travel to the CPU");
}

TEST(ValueCodecSparseMalformed, CoalescedFlagIsCheckedNotBelieved) {
  // Claims to be coalesced, but its indices are neither sorted nor unique:
  // it arrives as an uncoalesced tensor with the same entries.
  auto sent = encodeMessage({sampleSparse(at::kFloat)});
  sent.envelope.mutable_tensors(0)->set_coalesced(true);
  auto received = decodeMessage(throughWire(sent)).at(0).toTensor();
  EXPECT_FALSE(received.is_coalesced());
  EXPECT_TRUE(
      at::equal(received.to_dense(), sampleSparse(at::kFloat).to_dense()));
}

} // namespace
} // namespace detail
} // namespace rpc
} // namespace torchrpc
