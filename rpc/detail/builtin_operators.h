#pragma once

#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

namespace torchrpc {
namespace rpc {
namespace detail {

// True if `name` looks like a dispatcher schema name ("ns::op[.overload]").
bool isOperatorName(const std::string& name);

// Runs a dispatcher operator by schema name, e.g. "aten::add.Tensor" or
// "aten::matmul" (the overload may be left out when the arguments pick a
// unique one). Missing trailing arguments take the schema's defaults.
// Returns the single result, a tuple for several, None for none.
// Throws RpcError(kUnknownFunction) if no such operator exists and
// RpcError(kBadArguments) if the arguments fit no overload; an exception the
// operator itself throws propagates as is.
c10::IValue invokeBuiltinOperator(
    const std::string& name,
    std::vector<c10::IValue> args);

} // namespace detail
} // namespace rpc
} // namespace torchrpc
