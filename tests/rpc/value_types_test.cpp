// Tier 1: conversions between C++ values and IValues (rpc/value_types.h),
// containers of libtorch's types and of an upper layer's type.

#include "torchrpc/rpc/value_types.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/function_registry.h"
#include "torchrpc/rpc/future.h"

namespace torchrpc {
namespace testing {

// An upper layer's type, as RRef<T> is one: it travels as an int, converts
// itself (toIValue) and checks each value, not only its type.
struct Even {
  int64_t n = 0;
};

} // namespace testing

namespace rpc {
namespace detail {

template <>
struct ValueTraits<testing::Even> {
  static c10::TypePtr type() {
    return c10::IntType::get();
  }
  static bool accepts(const c10::IValue& value) {
    return value.isInt() && value.toInt() % 2 == 0;
  }
  static std::string explain(const c10::IValue& value) {
    return value.isInt() && value.toInt() % 2 != 0 ? "odd" : "";
  }
  static testing::Even from(c10::IValue&& value) {
    TORCH_CHECK(accepts(value), "not an even int");
    return testing::Even{value.toInt()};
  }
  static c10::IValue toIValue(const testing::Even& value) {
    return value.n;
  }
};

} // namespace detail
} // namespace rpc

namespace testing {
namespace {

using rpc::ErrorCode;
using rpc::detail::describeValue;
using rpc::detail::toIValue;
using rpc::detail::typeName;
using rpc::detail::ValueTraits;

c10::IValue typedList(
    c10::TypePtr elementType,
    std::vector<c10::IValue> values) {
  c10::impl::GenericList out(std::move(elementType));
  for (auto& value : values) {
    out.push_back(std::move(value));
  }
  return c10::IValue(std::move(out));
}

c10::IValue makeTuple(std::vector<c10::IValue> values) {
  return c10::IValue(c10::ivalue::Tuple::create(std::move(values)));
}

template <typename T>
bool accepts(const c10::IValue& value) {
  return ValueTraits<T>::accepts(value);
}

// toIValue, then accepts and from, as a call's two ends do.
template <typename T>
T roundTrip(const T& value) {
  c10::IValue converted = toIValue(value);
  EXPECT_TRUE(accepts<T>(converted)) << typeName(converted);
  return ValueTraits<T>::from(std::move(converted));
}

const c10::TypePtr kInt = c10::IntType::get();
const c10::TypePtr kFloat = c10::FloatType::get();
const c10::TypePtr kTensor = c10::TensorType::get();
const c10::TypePtr kAny = c10::AnyType::get();

// What these types accepted before containers composed their elements'
// traits; containers of libtorch's types are matched by their c10 type.
TEST(ValueTypes, ContainersOfLibtorchTypesAcceptWhatTheyDidBefore) {
  using IntVector = std::vector<int64_t>;
  EXPECT_EQ(typeName<IntVector>(), "List[int]");
  EXPECT_TRUE(accepts<IntVector>(typedList(kInt, {1, 2})));
  EXPECT_TRUE(accepts<IntVector>(typedList(kInt, {})));
  EXPECT_FALSE(accepts<IntVector>(typedList(kFloat, {1.5})));
  EXPECT_FALSE(accepts<IntVector>(typedList(kAny, {1})));
  EXPECT_FALSE(accepts<IntVector>(c10::IValue(1)));
  EXPECT_EQ(
      ValueTraits<IntVector>::from(typedList(kInt, {1, 2})),
      IntVector({1, 2}));

  // A float argument takes an int; a list of floats takes only floats.
  using DoubleVector = std::vector<double>;
  EXPECT_EQ(typeName<DoubleVector>(), "List[float]");
  EXPECT_TRUE(accepts<double>(c10::IValue(2)));
  EXPECT_TRUE(accepts<DoubleVector>(typedList(kFloat, {1.5})));
  EXPECT_TRUE(accepts<DoubleVector>(typedList(kFloat, {})));
  EXPECT_FALSE(accepts<DoubleVector>(typedList(kInt, {1, 2})));
  EXPECT_FALSE(accepts<DoubleVector>(typedList(kInt, {})));
  EXPECT_EQ(
      ValueTraits<DoubleVector>::from(typedList(kFloat, {1.5, 2.0})),
      DoubleVector({1.5, 2.0}));

  using TensorVector = std::vector<at::Tensor>;
  auto t = at::arange(3);
  EXPECT_TRUE(accepts<TensorVector>(typedList(kTensor, {t, t})));
  EXPECT_FALSE(accepts<TensorVector>(typedList(kAny, {t})));
  EXPECT_FALSE(accepts<TensorVector>(
      typedList(c10::OptionalType::create(kTensor), {t})));
  auto tensors =
      ValueTraits<TensorVector>::from(typedList(kTensor, {t, t * 2}));
  ASSERT_EQ(tensors.size(), 2u);
  EXPECT_TRUE(at::equal(tensors[1], t * 2));

  using OptionalInt = c10::optional<int64_t>;
  EXPECT_EQ(typeName<OptionalInt>(), "Optional[int]");
  EXPECT_TRUE(accepts<OptionalInt>(c10::IValue()));
  EXPECT_TRUE(accepts<OptionalInt>(c10::IValue(3)));
  EXPECT_FALSE(accepts<OptionalInt>(c10::IValue(2.5)));
  EXPECT_EQ(ValueTraits<OptionalInt>::from(c10::IValue(3)), OptionalInt(3));
  EXPECT_EQ(ValueTraits<OptionalInt>::from(c10::IValue()), c10::nullopt);

  using TensorAndDouble = std::tuple<at::Tensor, double>;
  EXPECT_EQ(typeName<TensorAndDouble>(), "Tuple[Tensor, float]");
  EXPECT_TRUE(accepts<TensorAndDouble>(makeTuple({t, 2.0})));
  EXPECT_FALSE(accepts<TensorAndDouble>(makeTuple({t, 2})));
  EXPECT_FALSE(accepts<TensorAndDouble>(makeTuple({t})));
  auto pair = ValueTraits<TensorAndDouble>::from(makeTuple({t, 2.0}));
  EXPECT_TRUE(at::equal(std::get<0>(pair), t));
  EXPECT_EQ(std::get<1>(pair), 2.0);

  using Counts = std::unordered_map<std::string, int64_t>;
  EXPECT_EQ(typeName<Counts>(), "Dict[str, int]");
  c10::impl::GenericDict counts(c10::StringType::get(), kInt);
  counts.insert("a", 1);
  EXPECT_TRUE(accepts<Counts>(c10::IValue(counts)));
  c10::impl::GenericDict anyCounts(c10::StringType::get(), kAny);
  anyCounts.insert("a", 1);
  EXPECT_FALSE(accepts<Counts>(c10::IValue(anyCounts)));
  EXPECT_EQ(ValueTraits<Counts>::from(c10::IValue(counts)), Counts({{"a", 1}}));

  // libtorch's own conversion still makes their IValues.
  EXPECT_EQ(typeName(toIValue(IntVector{})), "List[int]");
  EXPECT_EQ(typeName(toIValue(TensorVector{t})), "List[Tensor]");
  EXPECT_EQ(
      typeName(toIValue(TensorAndDouble{t, 1.0})),
      "Tuple[Tensor, float]");
}

// These did not compile: libtorch knows no narrow integer, float or
// std::vector<c10::IValue>.
TEST(ValueTypes, NarrowIntegersFloatsAndIValuesWorkInsideContainers) {
  EXPECT_EQ(typeName<std::vector<int32_t>>(), "List[int]");
  EXPECT_EQ(
      roundTrip(std::vector<int32_t>{1, -2}),
      (std::vector<int32_t>{1, -2}));
  EXPECT_EQ(typeName(toIValue(std::vector<int32_t>{})), "List[int]");
  EXPECT_FALSE(accepts<std::vector<int32_t>>(typedList(kFloat, {1.0})));
  EXPECT_EQ(roundTrip(std::vector<float>{0.5f}), std::vector<float>{0.5f});
  EXPECT_EQ(typeName(toIValue(std::vector<float>{})), "List[float]");
  EXPECT_EQ(roundTrip(c10::optional<int32_t>(7)), c10::optional<int32_t>(7));
  EXPECT_EQ(roundTrip(c10::optional<int32_t>()), c10::optional<int32_t>());
  EXPECT_EQ(
      roundTrip(std::tuple<int32_t, double>(3, 0.25)),
      (std::tuple<int32_t, double>(3, 0.25)));
  EXPECT_EQ(
      roundTrip(std::unordered_map<std::string, int32_t>{{"x", 9}}),
      (std::unordered_map<std::string, int32_t>{{"x", 9}}));
  EXPECT_EQ(
      roundTrip(std::vector<std::vector<int16_t>>{{1}, {}}),
      (std::vector<std::vector<int16_t>>{{1}, {}}));

  auto values = roundTrip(std::vector<c10::IValue>{c10::IValue(1), "a"});
  ASSERT_EQ(values.size(), 2u);
  EXPECT_EQ(values[0].toInt(), 1);
  EXPECT_EQ(values[1].toStringRef(), "a");
  EXPECT_EQ(typeName(toIValue(std::vector<c10::IValue>{})), "List[Any]");
}

TEST(ValueTypes, ContainersOfAnUpperLayersTypeCheckEveryElement) {
  using Evens = std::vector<Even>;
  EXPECT_EQ(typeName<Evens>(), "List[int]");
  c10::IValue evens = toIValue(Evens{{2}, {4}});
  EXPECT_EQ(typeName(evens), "List[int]");
  ASSERT_TRUE(accepts<Evens>(evens));
  auto back = ValueTraits<Evens>::from(std::move(evens));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[1].n, 4);

  // The static type fits, a value does not: the message names it.
  c10::IValue odd = typedList(kInt, {2, 3});
  EXPECT_FALSE(accepts<Evens>(odd));
  EXPECT_EQ(
      describeValue<Evens>(odd),
      "List[int] (element 1 has type int (odd))");
  // A list of Any is checked element by element; other lists are refused.
  EXPECT_TRUE(accepts<Evens>(typedList(kAny, {2})));
  EXPECT_FALSE(accepts<Evens>(typedList(kAny, {2, "x"})));
  EXPECT_EQ(
      describeValue<Evens>(typedList(kAny, {2, "x"})),
      "List[Any] (element 1 has type str)");
  EXPECT_FALSE(accepts<Evens>(typedList(kFloat, {})));
  EXPECT_EQ(describeValue<Evens>(typedList(kFloat, {})), "List[float]");

  // Empty containers carry the elements' type.
  EXPECT_EQ(typeName(toIValue(Evens{})), "List[int]");
  EXPECT_EQ(
      typeName(toIValue(std::vector<Evens>{{}, {{2}}})),
      "List[List[int]]");
  EXPECT_EQ(
      typeName(toIValue(std::unordered_map<std::string, Even>{})),
      "Dict[str, int]");

  using MaybeEven = c10::optional<Even>;
  EXPECT_TRUE(accepts<MaybeEven>(c10::IValue()));
  EXPECT_TRUE(toIValue(MaybeEven()).isNone());
  EXPECT_EQ(roundTrip(MaybeEven(Even{6}))->n, 6);
  EXPECT_FALSE(accepts<MaybeEven>(c10::IValue(5)));
  EXPECT_EQ(describeValue<MaybeEven>(c10::IValue(5)), "int (odd)");

  using Labelled = std::tuple<Even, std::string>;
  EXPECT_EQ(typeName<Labelled>(), "Tuple[int, str]");
  auto labelled = roundTrip(Labelled{Even{8}, "eight"});
  EXPECT_EQ(std::get<0>(labelled).n, 8);
  EXPECT_EQ(std::get<1>(labelled), "eight");
  EXPECT_FALSE(accepts<Labelled>(makeTuple({3, "three"})));
  EXPECT_EQ(
      describeValue<Labelled>(makeTuple({3, "three"})),
      "Tuple[int, str] (element 0 has type int (odd))");
  EXPECT_FALSE(accepts<Labelled>(makeTuple({2, 2})));
  EXPECT_EQ(describeValue<Labelled>(makeTuple({2, 2})), "Tuple[int, int]");
  EXPECT_FALSE(accepts<Labelled>(makeTuple({2})));

  using ByName = std::unordered_map<std::string, Even>;
  auto byName = roundTrip(ByName{{"a", Even{2}}, {"b", Even{10}}});
  EXPECT_EQ(byName.at("b").n, 10);
  c10::impl::GenericDict oddEntry(c10::StringType::get(), kInt);
  oddEntry.insert("b", 5);
  EXPECT_FALSE(accepts<ByName>(c10::IValue(oddEntry)));
  EXPECT_EQ(
      describeValue<ByName>(c10::IValue(oddEntry)),
      "Dict[str, int] (the value of key 'b' has type int (odd))");

  using Nested = std::vector<std::vector<Even>>;
  auto nested = roundTrip(Nested{{Even{2}}, {}, {Even{4}, Even{6}}});
  ASSERT_EQ(nested.size(), 3u);
  EXPECT_TRUE(nested[1].empty());
  EXPECT_EQ(nested[2][1].n, 6);
  c10::IValue deepOdd =
      typedList(c10::ListType::create(kInt), {typedList(kInt, {2, 7})});
  EXPECT_FALSE(accepts<Nested>(deepOdd));
  EXPECT_EQ(
      describeValue<Nested>(deepOdd),
      "List[List[int]] (element 0 has type List[int] "
      "(element 1 has type int (odd)))");
}

TEST(ValueTypes, RegisteredFunctionsRefuseAnElementWithItsReason) {
  rpc::FunctionRegistry registry;
  int runs = 0;
  registry.add("sum_evens", [&runs](std::vector<Even> evens) {
    ++runs;
    int64_t total = 0;
    for (const auto& even : evens) {
      total += even.n;
    }
    return total;
  });
  auto fn = registry.find("sum_evens");
  EXPECT_EQ(fn->signature, "sum_evens(List[int]) -> int");
  try {
    fn->invoke({typedList(kInt, {2, 3})});
    ADD_FAILURE() << "expected RpcError";
  } catch (const rpc::RpcError& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBadArguments);
    EXPECT_NE(
        std::string(e.what()).find(
            "argument 1 has type List[int] (element 1 has type int (odd)), "
            "expected List[int]"),
        std::string::npos)
        << e.what();
  }
  EXPECT_EQ(runs, 0);
  EXPECT_EQ(fn->invoke({typedList(kInt, {2, 4})})->value().toInt(), 6);
  EXPECT_EQ(runs, 1);
}

TEST(ValueTypes, ATypedResultThatDoesNotFitIsBadArguments) {
  try {
    rpc::detail::convertResult<std::vector<Even>>(
        typedList(kInt, {1}),
        "worker1",
        "make_evens");
    ADD_FAILURE() << "expected RpcError";
  } catch (const rpc::RpcError& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBadArguments);
    EXPECT_EQ(e.worker(), "worker1");
    EXPECT_EQ(e.function(), "make_evens");
    EXPECT_NE(
        std::string(e.what()).find(
            "result has type List[int] (element 0 has type int (odd)), "
            "the caller expects List[int]"),
        std::string::npos)
        << e.what();
  }
  auto evens = rpc::detail::convertResult<std::vector<Even>>(
      typedList(kInt, {2}),
      "worker1",
      "make_evens");
  ASSERT_EQ(evens.size(), 1u);
  EXPECT_EQ(evens[0].n, 2);
}

} // namespace
} // namespace testing
} // namespace torchrpc
