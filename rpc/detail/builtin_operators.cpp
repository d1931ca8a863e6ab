#include "torchrpc/rpc/detail/builtin_operators.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/function_schema.h>
#include <c10/util/Exception.h>

#include "torchrpc/rpc/errors.h"

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

c10::IValue packResults(std::vector<c10::IValue>&& stack) {
  if (stack.empty()) {
    return c10::IValue();
  }
  if (stack.size() == 1) {
    return std::move(stack[0]);
  }
  return c10::ivalue::Tuple::create(std::move(stack));
}

// Checks and completes `args` for the operator; returns false with the
// reason if they do not fit its schema.
bool fitArguments(
    const c10::OperatorHandle& op,
    std::vector<c10::IValue>& args,
    std::string* reason) {
  try {
    op.schema().checkAndNormalizeInputs(args);
    return true;
  } catch (const c10::Error& e) {
    *reason = e.what_without_backtrace();
    return false;
  }
}

} // namespace

bool isOperatorName(const std::string& name) {
  auto sep = name.find("::");
  return sep != std::string::npos && sep > 0 && sep + 2 < name.size();
}

c10::IValue invokeBuiltinOperator(
    const std::string& name,
    std::vector<c10::IValue> args) {
  auto dot = name.find('.', name.find("::"));
  std::string opName = name.substr(0, dot);
  std::string overload =
      dot == std::string::npos ? std::string() : name.substr(dot + 1);
  auto& dispatcher = c10::Dispatcher::singleton();

  std::vector<c10::OperatorHandle> candidates;
  if (auto op = dispatcher.findSchema({opName, overload})) {
    candidates.push_back(*op);
  } else if (dot == std::string::npos) {
    // No overload named: any overload whose schema the arguments fit.
    for (const auto& known : dispatcher.getAllOpNames()) {
      if (known.name == opName) {
        if (auto op = dispatcher.findSchema(known)) {
          candidates.push_back(*op);
        }
      }
    }
  }
  if (candidates.empty()) {
    throw RpcError(
        ErrorCode::kUnknownFunction,
        "",
        name,
        0,
        "no registered function or operator named '" + name + "'");
  }

  std::string reasons;
  for (const auto& op : candidates) {
    std::vector<c10::IValue> stack = args;
    std::string reason;
    if (!fitArguments(op, stack, &reason)) {
      reasons += (reasons.empty() ? "" : "; ") + reason;
      continue;
    }
    op.callBoxed(&stack);
    return packResults(std::move(stack));
  }
  throw RpcError(ErrorCode::kBadArguments, "", name, 0, reasons);
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
