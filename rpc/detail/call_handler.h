#pragma once

#include "torchrpc/rpc/function_registry.h"
#include "torchrpc/rpc/request.h"

namespace torchrpc {
namespace rpc {
namespace detail {

// Runs the registered function `name`, or else a dispatcher operator (if
// allowed), on this worker. Throws RpcError kUnknownFunction or
// kBadArguments before running anything; whatever the function throws, or
// the error of the future it returns, completes the returned future with
// kRemoteException carrying the cause's text.
c10::intrusive_ptr<c10::ivalue::Future> invokeFunction(
    const FunctionRegistry& functions,
    const std::string& selfName,
    bool allowBuiltinOperators,
    const std::string& name,
    std::vector<c10::IValue>&& args);

// The handler of kCallMessageKind: invokeFunction() with the function named
// by the request body.
RequestHandler makeCallHandler(
    const FunctionRegistry& functions,
    std::string selfName,
    bool allowBuiltinOperators);

// Builtin operators run inline on at most this many bytes of tensors: their
// cost grows with their inputs, and an operator on big tensors would hold
// up the connection's other messages.
constexpr uint64_t kInlineOperatorBytes = 64 << 10;

// Which calls run where they arrive (Note [Where messages are handled] in
// rpc/agent.cpp): functions registered cheap, and builtin operators (when
// allowed) on at most kInlineOperatorBytes of tensors.
RunsInline makeCallRunsInline(
    const FunctionRegistry& functions,
    bool allowBuiltinOperators);

} // namespace detail
} // namespace rpc
} // namespace torchrpc
