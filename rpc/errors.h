#pragma once

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>

namespace torchrpc {
namespace rpc {

// Why an asynchronous operation failed. The code travels in the envelope's
// status field and the caller rebuilds a typed RpcError from it; message text
// is never parsed. See the error table in README.md for which codes the
// runtime raises itself and what to do about each.
enum class ErrorCode : uint32_t {
  kOk = 0,
  // The call did not complete before its deadline. The remote side may still
  // have run it (or be running it: a handler sees currentRequestCancelled());
  // a call it had not started yet is dropped there. Retry only idempotent
  // calls.
  kTimeout = 1,
  // The callee has no function or operator of that name. Do not retry.
  kUnknownFunction = 2,
  // The arguments (or the result) do not match the function's signature.
  // Do not retry: fix the call.
  kBadArguments = 3,
  // The remote function threw. The message carries its text.
  kRemoteException = 4,
  // The worker is unknown, unreachable, or its connection failed while the
  // call was in flight. Retry after the peer is back.
  kWorkerUnavailable = 5,
  // Bytes on the wire did not decode. The connection they came on is closed.
  kMalformedMessage = 6,
  // A message exceeds a configured size cap. Do not retry as is.
  kTooLarge = 7,
  // The runtime is shutting down or has shut down. Do not retry here.
  kShuttingDown = 8,
  // A broken invariant inside torchrpc. Please report it.
  kInternal = 9,
};

const char* errorCodeName(ErrorCode code);

// The error every torchrpc future completes with. It names the worker that
// raised it (or that could not be reached), the function or message kind it
// concerned, and the id of the message (0 when there was none).
class RpcError : public std::runtime_error {
 public:
  RpcError(
      ErrorCode code,
      std::string worker,
      std::string function,
      uint64_t messageId,
      std::string detail);

  ErrorCode code() const noexcept {
    return code_;
  }
  const std::string& worker() const noexcept {
    return worker_;
  }
  const std::string& function() const noexcept {
    return function_;
  }
  uint64_t messageId() const noexcept {
    return messageId_;
  }
  // The cause alone, without the worker/function prefix of what().
  const std::string& detail() const noexcept {
    return detail_;
  }

 private:
  ErrorCode code_;
  std::string worker_;
  std::string function_;
  uint64_t messageId_;
  std::string detail_;
};

// Builds an exception_ptr holding an RpcError, for Future::setError.
std::exception_ptr makeRpcError(
    ErrorCode code,
    const std::string& worker,
    const std::string& function,
    uint64_t messageId,
    const std::string& detail);

// Text of any exception, without libtorch's C++ backtrace: c10::Error::what()
// appends kilobytes of stack frames that mean nothing to another worker, so
// every exception that becomes an error message goes through one of these.
std::string describeException(const std::exception_ptr& error);
std::string describeException(const std::exception& error);

} // namespace rpc
} // namespace torchrpc
