#include "torchrpc/rpc/errors.h"

#include <c10/util/Exception.h>

#include <sstream>

namespace torchrpc {
namespace rpc {

const char* errorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "ok";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kUnknownFunction:
      return "unknown function";
    case ErrorCode::kBadArguments:
      return "bad arguments";
    case ErrorCode::kRemoteException:
      return "remote exception";
    case ErrorCode::kWorkerUnavailable:
      return "worker unavailable";
    case ErrorCode::kMalformedMessage:
      return "malformed message";
    case ErrorCode::kTooLarge:
      return "too large";
    case ErrorCode::kShuttingDown:
      return "shutting down";
    case ErrorCode::kInternal:
      return "internal error";
  }
  return "unknown error code";
}

namespace {

std::string formatWhat(
    ErrorCode code,
    const std::string& worker,
    const std::string& function,
    uint64_t messageId,
    const std::string& detail) {
  std::ostringstream out;
  out << "[" << errorCodeName(code) << "] worker '" << worker << "'";
  if (!function.empty()) {
    out << ", function '" << function << "'";
  }
  if (messageId != 0) {
    out << ", message #" << messageId;
  }
  out << ": " << detail;
  return out.str();
}

} // namespace

RpcError::RpcError(
    ErrorCode code,
    std::string worker,
    std::string function,
    uint64_t messageId,
    std::string detail)
    : std::runtime_error(formatWhat(code, worker, function, messageId, detail)),
      code_(code),
      worker_(std::move(worker)),
      function_(std::move(function)),
      messageId_(messageId),
      detail_(std::move(detail)) {}

std::exception_ptr makeRpcError(
    ErrorCode code,
    const std::string& worker,
    const std::string& function,
    uint64_t messageId,
    const std::string& detail) {
  return std::make_exception_ptr(
      RpcError(code, worker, function, messageId, detail));
}

std::string describeException(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return describeException(e);
  } catch (...) {
    return "unknown exception";
  }
}

std::string describeException(const std::exception& error) {
  if (const auto* c10Error = dynamic_cast<const c10::Error*>(&error)) {
    return c10Error->what_without_backtrace();
  }
  return error.what();
}

} // namespace rpc
} // namespace torchrpc
