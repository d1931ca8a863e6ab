// Tier 2: RRefs inside typed containers (std::vector, std::tuple,
// c10::optional, std::unordered_map, nested) as arguments and results of
// registered functions, across workers; and the errors of values that are
// not what an RRef<T> needs.

#include <ATen/ATen.h>
#include <ATen/core/rref_interface.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "tests/support/rref_cluster.h"
#include "torchrpc/rpc/function_registry.h"

namespace torchrpc {
namespace testing {
namespace {

using rpc::ErrorCode;
using rref::RRef;
using TensorRRef = RRef<at::Tensor>;
using TensorRRefs = std::vector<TensorRRef>;

// An RRef that torchrpc did not create, as PyTorch's own RPC makes them.
class ForeignRRef : public c10::RRefInterface {
 public:
  c10::worker_id_t owner() const override {
    return 1;
  }
  std::string ownerName() const override {
    return "pytorch_worker";
  }
  bool isOwner() const override {
    return false;
  }
  bool confirmedByOwner() const override {
    return true;
  }
  const c10::TypePtr type() const override {
    return c10::TensorType::get();
  }
};

c10::IValue foreignRRef() {
  return c10::IValue(c10::intrusive_ptr<c10::RRefInterface>(
      c10::make_intrusive<ForeignRRef>()));
}

c10::IValue rrefList(std::vector<c10::IValue> values) {
  c10::impl::GenericList list(c10::RRefType::create(c10::TensorType::get()));
  for (auto& value : values) {
    list.push_back(std::move(value));
  }
  return c10::IValue(std::move(list));
}

double sumOf(const TensorRRefs& rrefs) {
  double total = 0;
  for (const auto& r : rrefs) {
    total += r.toHere().sum().item<double>();
  }
  return total;
}

void registerFunctions(int rank, rpc::Runtime& rt) {
  rt.functions().add("scale", [](at::Tensor x, double factor) {
    return x * factor;
  });
  rt.functions().add("sum_all", &sumOf);
  rt.functions().add("sum_one", [](TensorRRef r) {
    return r.toHere().sum().item<double>();
  });
  rt.functions().add("owners_of", [](TensorRRefs rrefs) {
    std::vector<int64_t> owners;
    for (const auto& r : rrefs) {
      owners.push_back(r.owner().id);
    }
    return owners;
  });
  // n RRefs owned here, of full({2}, i).
  rt.functions().add("make_many", [&rt](int64_t n) {
    TensorRRefs made;
    for (int64_t i = 0; i < n; ++i) {
      made.push_back(TensorRRef::local(rt, at::full({2}, double(i))));
    }
    return made;
  });
  rt.functions().add("echo_list", [](TensorRRefs rrefs) { return rrefs; });
  rt.functions().add("echo_any", [](std::vector<RRef<c10::IValue>> rrefs) {
    return rrefs;
  });
  rt.functions().add("with_count", [&rt](std::tuple<TensorRRef, int64_t> in) {
    auto [r, n] = std::move(in);
    return std::make_tuple(
        TensorRRef::local(rt, r.toHere() * double(n)),
        n + 1);
  });
  rt.functions().add(
      "maybe_double",
      [&rt](c10::optional<TensorRRef> r) -> c10::optional<TensorRRef> {
        if (!r) {
          return c10::nullopt;
        }
        return TensorRRef::local(rt, r->toHere() * 2);
      });
  rt.functions().add(
      "scale_named",
      [&rt](std::unordered_map<std::string, TensorRRef> named) {
        std::unordered_map<std::string, TensorRRef> scaled;
        for (const auto& entry : named) {
          scaled.emplace(
              entry.first,
              TensorRRef::local(rt, entry.second.toHere() * 10));
        }
        return scaled;
      });
  rt.functions().add("echo_nested", [](std::vector<TensorRRefs> groups) {
    return groups;
  });
  rt.functions().add("group_sums", [](std::vector<TensorRRefs> groups) {
    std::vector<double> sums;
    for (const auto& group : groups) {
      sums.push_back(sumOf(group));
    }
    return sums;
  });
  // Results that are not lists of RRef[Tensor].
  rt.functions().add("ints", []() { return std::vector<int64_t>{1, 2}; });
  rt.functions().add("int_rrefs", [&rt]() {
    return std::vector<RRef<int64_t>>{RRef<int64_t>::local(rt, 5)};
  });
  rt.functions().add("rref_and_int", [](TensorRRef r) {
    c10::impl::GenericList list(c10::AnyType::get());
    list.push_back(r.toIValue());
    list.push_back(3);
    return c10::IValue(std::move(list));
  });
}

class RRefContainers : public ::testing::TestWithParam<rpc::TransportKind> {
 protected:
  void SetUp() override {
    cluster_ = std::make_unique<RRefCluster>(GetParam(), 3, &registerFunctions);
    // a = [1, 1] owned by worker1, b = [2, 2] owned by worker2.
    a_ =
        rref::remote<at::Tensor>(rt(0), "worker1", "scale", at::ones({2}), 1.0);
    b_ =
        rref::remote<at::Tensor>(rt(0), "worker2", "scale", at::ones({2}), 2.0);
  }
  void TearDown() override {
    a_ = TensorRRef();
    b_ = TensorRRef();
    if (cluster_) {
      // Every reference sent inside a container was given back.
      EXPECT_TRUE(cluster_->waitForEmptyTables());
      EXPECT_TRUE(cluster_->shutdownAll());
    }
  }
  rpc::Runtime& rt(int rank) {
    return (*cluster_)[rank];
  }

  std::unique_ptr<RRefCluster> cluster_;
  TensorRRef a_;
  TensorRRef b_;
};

TEST_P(RRefContainers, VectorsOfRRefsAreArgumentsAndResults) {
  EXPECT_EQ(
      rt(0).rpcSync<double>("worker2", "sum_all", TensorRRefs{a_, b_}),
      6);
  EXPECT_EQ(
      rt(0).rpcSync<std::vector<int64_t>>(
          "worker2",
          "owners_of",
          TensorRRefs{a_, b_, a_}),
      (std::vector<int64_t>{1, 2, 1}));

  // Made and owned by worker1, held here.
  auto made = rt(0).rpcSync<TensorRRefs>("worker1", "make_many", 3);
  ASSERT_EQ(made.size(), 3u);
  for (size_t i = 0; i < made.size(); ++i) {
    EXPECT_EQ(made[i].owner().id, 1);
    EXPECT_FALSE(made[i].isOwner());
    EXPECT_TRUE(at::equal(made[i].toHere(), at::full({2}, double(i))));
  }
  EXPECT_EQ(cluster_->context(1).counters().ownerRRefs, 4u); // a_ and made

  // There and back: the same references, owners unchanged.
  auto echoed = rt(0)
                    .rpcAsync<TensorRRefs>(
                        "worker2",
                        "echo_list",
                        TensorRRefs{a_, b_, made[2]})
                    .wait();
  ASSERT_EQ(echoed.size(), 3u);
  EXPECT_EQ(echoed[0].id(), a_.id());
  EXPECT_EQ(echoed[1].id(), b_.id());
  EXPECT_EQ(echoed[2].id(), made[2].id());
  EXPECT_EQ(echoed[0].owner().id, 1);
  EXPECT_EQ(echoed[1].owner().id, 2);
  EXPECT_TRUE(at::equal(echoed[0].toHere(), at::ones({2})));
  EXPECT_TRUE(at::equal(echoed[1].toHere(), at::full({2}, 2.0)));
  EXPECT_TRUE(at::equal(echoed[2].toHere(), at::full({2}, 2.0)));
  // To its owner and back: the owner's reference.
  auto home =
      rt(0).rpcSync<TensorRRefs>("worker1", "echo_list", TensorRRefs{a_});
  ASSERT_EQ(home.size(), 1u);
  EXPECT_EQ(home[0].id(), a_.id());

  // Empty lists carry their type: the receiver's check passes both ways.
  EXPECT_TRUE(rt(0)
                  .rpcSync<TensorRRefs>("worker1", "echo_list", TensorRRefs{})
                  .empty());
  EXPECT_EQ(rt(0).rpcSync<double>("worker1", "sum_all", TensorRRefs{}), 0);
  EXPECT_TRUE(rt(0).rpcSync<TensorRRefs>("worker2", "make_many", 0).empty());
}

// RRef types are invariant: a list of RRef<c10::IValue> holding RRefs of
// tensors travels as a list of Any, and each element is checked.
TEST_P(RRefContainers, ListsOfRRefsOfAnyTypeHoldRRefsOfEveryType) {
  std::vector<RRef<c10::IValue>> anyRRefs{
      RRef<c10::IValue>::fromIValue(a_.toIValue()),
      RRef<c10::IValue>::fromIValue(b_.toIValue())};
  auto echoed = rt(0).rpcSync<std::vector<RRef<c10::IValue>>>(
      "worker1",
      "echo_any",
      anyRRefs);
  ASSERT_EQ(echoed.size(), 2u);
  EXPECT_EQ(echoed[1].id(), b_.id());
  EXPECT_TRUE(at::equal(echoed[1].toHere().toTensor(), at::full({2}, 2.0)));
  // Back as RRefs of tensors: their own type says they are.
  auto typed = rt(0).rpcSync<TensorRRefs>("worker2", "echo_any", anyRRefs);
  ASSERT_EQ(typed.size(), 2u);
  EXPECT_TRUE(at::equal(typed[0].toHere(), at::ones({2})));
}

TEST_P(RRefContainers, TuplesOfAnRRefAndAnInt) {
  using Counted = std::tuple<TensorRRef, int64_t>;
  auto [r, n] =
      rt(0).rpcSync<Counted>("worker2", "with_count", Counted{a_, int64_t(3)});
  EXPECT_EQ(n, 4);
  EXPECT_EQ(r.owner().id, 2);
  EXPECT_TRUE(at::equal(r.toHere(), at::full({2}, 3.0)));
}

TEST_P(RRefContainers, OptionalRRefsSetAndUnset) {
  using MaybeRRef = c10::optional<TensorRRef>;
  auto doubled =
      rt(0).rpcSync<MaybeRRef>("worker2", "maybe_double", MaybeRRef(a_));
  ASSERT_TRUE(doubled.has_value());
  EXPECT_EQ(doubled->owner().id, 2);
  EXPECT_TRUE(at::equal(doubled->toHere(), at::full({2}, 2.0)));
  EXPECT_FALSE(rt(0)
                   .rpcSync<MaybeRRef>("worker2", "maybe_double", MaybeRRef())
                   .has_value());
  // An empty RRef travels as None.
  EXPECT_FALSE(rt(0)
                   .rpcSync<MaybeRRef>(
                       "worker1",
                       "maybe_double",
                       MaybeRRef(TensorRRef()))
                   .has_value());
}

TEST_P(RRefContainers, MapsOfRRefs) {
  using Named = std::unordered_map<std::string, TensorRRef>;
  auto scaled = rt(0).rpcSync<Named>(
      "worker1",
      "scale_named",
      Named{{"a", a_}, {"b", b_}});
  ASSERT_EQ(scaled.size(), 2u);
  EXPECT_EQ(scaled.at("a").owner().id, 1);
  EXPECT_EQ(scaled.at("b").owner().id, 1);
  EXPECT_TRUE(at::equal(scaled.at("a").toHere(), at::full({2}, 10.0)));
  EXPECT_TRUE(at::equal(scaled.at("b").toHere(), at::full({2}, 20.0)));
  EXPECT_TRUE(rt(0).rpcSync<Named>("worker2", "scale_named", Named{}).empty());
}

TEST_P(RRefContainers, NestedVectorsOfRRefs) {
  std::vector<TensorRRefs> groups{{a_, b_}, {}, {b_}};
  auto echoed =
      rt(0).rpcSync<std::vector<TensorRRefs>>("worker2", "echo_nested", groups);
  ASSERT_EQ(echoed.size(), 3u);
  ASSERT_EQ(echoed[0].size(), 2u);
  EXPECT_TRUE(echoed[1].empty());
  ASSERT_EQ(echoed[2].size(), 1u);
  EXPECT_EQ(echoed[0][0].id(), a_.id());
  EXPECT_EQ(echoed[0][1].id(), b_.id());
  EXPECT_EQ(echoed[2][0].id(), b_.id());
  EXPECT_EQ(echoed[0][0].owner().id, 1);
  EXPECT_EQ(echoed[2][0].owner().id, 2);
  EXPECT_TRUE(at::equal(echoed[2][0].toHere(), at::full({2}, 2.0)));
  EXPECT_EQ(
      rt(0).rpcSync<std::vector<double>>("worker1", "group_sums", groups),
      (std::vector<double>{6, 0, 4}));
}

TEST_P(RRefContainers, ResultsThatDoNotFitAreBadArguments) {
  expectRpcErrorFrom(
      [&]() { rt(0).rpcSync<TensorRRefs>("worker1", "ints"); },
      ErrorCode::kBadArguments,
      "worker1",
      {"ints", "result has type List[int]", "expects List[RRef[Tensor]]"});
  expectRpcErrorFrom(
      [&]() { rt(0).rpcAsync<TensorRRefs>("worker1", "int_rrefs").wait(); },
      ErrorCode::kBadArguments,
      "worker1",
      {"result has type List[RRef[int]]", "expects List[RRef[Tensor]]"});
  expectRpcErrorFrom(
      [&]() { rt(0).rpcSync<TensorRRefs>("worker2", "rref_and_int", a_); },
      ErrorCode::kBadArguments,
      "worker2",
      {"List[Any] (element 1 has type int)", "expects List[RRef[Tensor]]"});
  // The same value, as the caller asks for it, is fine.
  auto untyped = rt(0).rpcSync<c10::IValue>("worker2", "rref_and_int", a_);
  EXPECT_EQ(TensorRRef::fromIValue(untyped.toListRef()[0]).id(), a_.id());
}

TEST_P(RRefContainers, ArgumentsThatDoNotFitAreBadArguments) {
  expectRpcErrorFrom(
      [&]() {
        rt(0).rpcSync<double>("worker1", "sum_all", std::vector<int64_t>{1});
      },
      ErrorCode::kBadArguments,
      "worker1",
      {"sum_all",
       "argument 1 has type List[int], expected List[RRef[Tensor]]"});
  // Empty, too: the list's type says what it is.
  expectRpcErrorFrom(
      [&]() {
        rt(0).rpcSync<double>("worker1", "sum_all", std::vector<int64_t>{});
      },
      ErrorCode::kBadArguments,
      "worker1",
      {"argument 1 has type List[int]"});
  auto intRRef = RRef<int64_t>::local(rt(0), 7);
  expectRpcErrorFrom(
      [&]() {
        rt(0).rpcSync<double>(
            "worker2",
            "sum_all",
            std::vector<RRef<int64_t>>{intRRef});
      },
      ErrorCode::kBadArguments,
      "worker2",
      {"argument 1 has type List[RRef[int]], expected List[RRef[Tensor]]"});
  expectRpcErrorFrom(
      [&]() {
        rt(0).rpcSync<std::tuple<TensorRRef, int64_t>>(
            "worker2",
            "with_count",
            std::make_tuple(intRRef, int64_t(2)));
      },
      ErrorCode::kBadArguments,
      "worker2",
      {"with_count",
       "argument 1 has type Tuple[RRef[int], int], expected "
       "Tuple[RRef[Tensor], int]"});
  expectRpcErrorFrom(
      [&]() {
        rt(0).rpcSync<c10::optional<TensorRRef>>("worker1", "maybe_double", 3);
      },
      ErrorCode::kBadArguments,
      "worker1",
      {"argument 1 has type int, expected Optional[RRef[Tensor]]"});
  expectRpcErrorFrom(
      [&]() {
        rt(0).rpcSync<std::unordered_map<std::string, TensorRRef>>(
            "worker1",
            "scale_named",
            std::unordered_map<std::string, int64_t>{{"a", 1}});
      },
      ErrorCode::kBadArguments,
      "worker1",
      {"argument 1 has type Dict[str, int], expected Dict[str, RRef[Tensor]]"});
  // An empty RRef travels as None, which an RRef and a list of RRefs refuse.
  expectRpcErrorFrom(
      [&]() { rt(0).rpcSync<double>("worker2", "sum_one", TensorRRef()); },
      ErrorCode::kBadArguments,
      "worker2",
      {"argument 1 has type NoneType, expected RRef[Tensor]"});
  expectRpcErrorFrom(
      [&]() {
        rt(0).rpcSync<double>(
            "worker1",
            "sum_all",
            TensorRRefs{a_, TensorRRef()});
      },
      ErrorCode::kBadArguments,
      "worker1",
      {"element 1 has type NoneType", "expected List[RRef[Tensor]]"});
  // An RRef that torchrpc did not create cannot be sent.
  expectRpcError(
      [&]() {
        rt(0).rpcSync<double>("worker1", "sum_all", rrefList({foreignRRef()}));
      },
      ErrorCode::kBadArguments,
      {"did not create"});
}

// The RRef<T> API on values that hold no RRef of T: clear c10::Errors.
TEST_P(RRefContainers, MalformedValuesAreClearErrorsWhenMadeRRefs) {
  auto intRRef = RRef<int64_t>::local(rt(0), 7);
  auto expectError = [](const std::function<void()>& fn,
                        std::initializer_list<std::string> fragments) {
    try {
      fn();
      ADD_FAILURE() << "expected c10::Error";
    } catch (const c10::Error& e) {
      std::string what = e.what_without_backtrace();
      EXPECT_EQ(what.find("INTERNAL ASSERT"), std::string::npos) << what;
      for (const auto& fragment : fragments) {
        EXPECT_NE(what.find(fragment), std::string::npos)
            << "'" << fragment << "' not in: " << what;
      }
    }
  };
  using Traits = rpc::detail::ValueTraits<TensorRRef>;
  expectError(
      []() { TensorRRef::fromIValue(c10::IValue(3)); },
      {"expected an RRef", "int"});
  expectError(
      []() { TensorRRef::fromIValue(c10::IValue()); },
      {"expected an RRef", "NoneType"});
  expectError(
      []() { TensorRRef::fromIValue(foreignRRef()); },
      {"expected an RRef"});
  expectError(
      [&]() { TensorRRef::fromIValue(intRRef.toIValue()); },
      {"expected an RRef[Tensor], got an RRef[int]"});
  expectError(
      []() { TensorRRef::fromIValue(TensorRRef().toIValue()); },
      {"expected an RRef", "RRef (empty)"});
  expectError(
      []() { Traits::from(c10::IValue(3)); },
      {"expected an RRef[Tensor] created by torchrpc, got a value of type int"});
  expectError(
      []() { Traits::from(foreignRRef()); },
      {"RRef[Tensor] (an RRef that torchrpc did not create)"});
  expectError(
      []() { Traits::from(TensorRRef().toIValue()); },
      {"got a value of type RRef (empty)"});
  expectError(
      [&]() { Traits::from(intRRef.toIValue()); },
      {"expected an RRef[Tensor], got an RRef[int]"});
  EXPECT_FALSE(Traits::accepts(foreignRRef()));
  EXPECT_FALSE(Traits::accepts(TensorRRef().toIValue()));
  EXPECT_TRUE(Traits::from(a_.toIValue()).id() == a_.id());

  // A registered function refuses them before it runs.
  rpc::FunctionRegistry registry;
  int runs = 0;
  registry.add("count", [&runs](TensorRRefs rrefs) {
    ++runs;
    return int64_t(rrefs.size());
  });
  expectRpcError(
      [&]() { registry.find("count")->invoke({rrefList({foreignRRef()})}); },
      ErrorCode::kBadArguments,
      {"count",
       "element 0 has type RRef[Tensor] (an RRef that torchrpc did not "
       "create)"});
  expectRpcError(
      [&]() {
        registry.find("count")->invoke({rrefList({a_.toIValue(), 2})});
      },
      ErrorCode::kBadArguments,
      {"element 1 has type int"});
  EXPECT_EQ(runs, 0);
  EXPECT_EQ(
      registry.find("count")
          ->invoke({rrefList({a_.toIValue()})})
          ->value()
          .toInt(),
      1);
}

INSTANTIATE_TEST_SUITE_P(
    Transports,
    RRefContainers,
    ::testing::Values(rpc::TransportKind::kInProcess, rpc::TransportKind::kTcp),
    transportParamName);

} // namespace
} // namespace testing
} // namespace torchrpc
