#include "torchrpc/rpc/detail/call_handler.h"

#include "torchrpc/rpc/detail/builtin_operators.h"
#include "torchrpc/rpc/errors.h"
#include "torchrpc/rpc/future.h"

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

// The function's own failures are remote exceptions, whatever their type: a
// nested call that timed out inside the function does not mean this call
// timed out.
c10::intrusive_ptr<c10::ivalue::Future> asRemoteException(
    c10::intrusive_ptr<c10::ivalue::Future> result,
    const std::string& selfName,
    const std::string& function) {
  if (result->completed() && !result->hasError()) {
    return result;
  }
  auto out = c10::make_intrusive<c10::ivalue::Future>(c10::AnyType::get());
  result->addCallback([out, selfName, function](c10::ivalue::Future& done) {
    if (done.hasError()) {
      out->setError(makeRpcError(
          ErrorCode::kRemoteException,
          selfName,
          function,
          0,
          describeException(done.exception_ptr())));
    } else {
      out->markCompleted(done.value());
    }
  });
  return out;
}

} // namespace

c10::intrusive_ptr<c10::ivalue::Future> invokeFunction(
    const FunctionRegistry& functions,
    const std::string& selfName,
    bool allowBuiltinOperators,
    const std::string& name,
    std::vector<c10::IValue>&& args) {
  if (auto function = functions.find(name)) {
    // Throws RpcError(kBadArguments) before running anything.
    auto result = function->invoke(std::move(args));
    return asRemoteException(std::move(result), selfName, name);
  }
  if (allowBuiltinOperators && isOperatorName(name)) {
    try {
      return readyFuture(invokeBuiltinOperator(name, std::move(args)));
    } catch (const RpcError&) {
      throw;
    } catch (...) {
      return failedFuture(makeRpcError(
          ErrorCode::kRemoteException,
          selfName,
          name,
          0,
          describeException(std::current_exception())));
    }
  }
  throw RpcError(
      ErrorCode::kUnknownFunction,
      selfName,
      name,
      0,
      isOperatorName(name) && !allowBuiltinOperators
          ? "builtin operators are disabled on this worker"
          : "no function named '" + name + "' is registered");
}

RequestHandler makeCallHandler(
    const FunctionRegistry& functions,
    std::string selfName,
    bool allowBuiltinOperators) {
  return [&functions, selfName, allowBuiltinOperators](Request&& request) {
    return invokeFunction(
        functions,
        selfName,
        allowBuiltinOperators,
        request.body,
        std::move(request.values));
  };
}

RunsInline makeCallRunsInline(
    const FunctionRegistry& functions,
    bool allowBuiltinOperators) {
  return
      [&functions,
       allowBuiltinOperators](const std::string& name, uint64_t tensorBytes) {
        if (auto function = functions.find(name)) {
          return function->options.cheap;
        }
        return allowBuiltinOperators && tensorBytes <= kInlineOperatorBytes &&
            isOperatorName(name);
      };
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
