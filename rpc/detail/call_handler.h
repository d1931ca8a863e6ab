#pragma once

#include "rpc/agent.h"
#include "rpc/function_registry.h"

namespace torchrpc {
namespace rpc {
namespace detail {

// The handler of kCallMessageKind: runs the registered function named by the
// request body, or else a dispatcher operator (if allowed). Raises
// kUnknownFunction and kBadArguments itself; whatever the function throws, or
// the error of the future it returns, becomes kRemoteException carrying the
// cause's text.
RequestHandler makeCallHandler(
    const FunctionRegistry& functions,
    std::string selfName,
    bool allowBuiltinOperators);

} // namespace detail
} // namespace rpc
} // namespace torchrpc
