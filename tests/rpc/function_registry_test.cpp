#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "torchrpc/rpc/function_registry.h"

namespace torchrpc {
namespace {

using rpc::ErrorCode;
using rpc::FunctionRegistry;

at::Tensor scale(at::Tensor x, double factor) {
  return x * factor;
}

std::vector<c10::IValue> args(std::initializer_list<c10::IValue> values) {
  return std::vector<c10::IValue>(values);
}

TEST(FunctionRegistry, DeducesTheSignatureFromTheCallable) {
  FunctionRegistry registry;
  registry.add("scale", &scale);
  registry.add("join", [](std::vector<std::string> parts, int64_t n) {
    return parts.size() + n;
  });
  EXPECT_EQ(
      registry.find("scale")->signature,
      "scale(Tensor, float) -> Tensor");
  EXPECT_EQ(registry.find("join")->signature, "join(List[str], int) -> int");
  EXPECT_EQ(registry.find("missing"), nullptr);
  EXPECT_EQ(registry.names(), std::vector<std::string>({"join", "scale"}));
}

TEST(FunctionRegistry, RefusesDuplicateAndEmptyNames) {
  FunctionRegistry registry;
  registry.add("f", []() { return 1; });
  EXPECT_THROW(registry.add("f", []() { return 2; }), c10::Error);
  EXPECT_THROW(registry.add("", []() { return 2; }), c10::Error);
}

TEST(FunctionRegistry, InvokeChecksArgumentsBeforeRunning) {
  FunctionRegistry registry;
  int runs = 0;
  registry.add("count", [&runs](int64_t x) {
    ++runs;
    return x;
  });
  auto fn = registry.find("count");
  try {
    fn->invoke(args({c10::IValue("nope")}));
    ADD_FAILURE() << "expected RpcError";
  } catch (const rpc::RpcError& e) {
    EXPECT_EQ(e.code(), ErrorCode::kBadArguments);
    EXPECT_NE(
        std::string(e.what()).find("argument 1 has type str"),
        std::string::npos)
        << e.what();
  }
  EXPECT_EQ(runs, 0);
  auto result = fn->invoke(args({c10::IValue(int64_t(5))}));
  EXPECT_EQ(result->value().toInt(), 5);
  EXPECT_EQ(runs, 1);
}

TEST(FunctionRegistry, ExceptionsOfTheFunctionBecomeTheFuturesError) {
  FunctionRegistry registry;
  registry.add("boom", []() -> int64_t { throw std::runtime_error("boom!"); });
  auto result = registry.find("boom")->invoke({});
  ASSERT_TRUE(result->completed());
  ASSERT_TRUE(result->hasError());
  EXPECT_EQ(rpc::describeException(result->exception_ptr()), "boom!");
}

TEST(FunctionRegistry, FunctionsReturningFuturesRunAsynchronously) {
  FunctionRegistry registry;
  auto pending = c10::make_intrusive<c10::ivalue::Future>(c10::IntType::get());
  registry.add("async", [pending]() { return rpc::Future<int64_t>(pending); });
  auto result = registry.find("async")->invoke({});
  EXPECT_FALSE(result->completed());
  pending->markCompleted(int64_t(7));
  EXPECT_EQ(result->value().toInt(), 7);
}

} // namespace
} // namespace torchrpc
