#include "torchrpc/nn/remote_module.h"

#include <c10/util/Exception.h>

namespace torchrpc {
namespace nn {
namespace detail {

std::pair<std::string, std::string> splitLocation(const std::string& on) {
  auto slash = on.find('/');
  if (slash == std::string::npos) {
    TORCH_CHECK(!on.empty(), "a RemoteModule needs a worker to live on");
    return {on, "cpu"};
  }
  std::string worker = on.substr(0, slash);
  std::string device = on.substr(slash + 1);
  TORCH_CHECK(
      !worker.empty() && !device.empty(),
      "'",
      on,
      "' is no module location (\"worker\" or \"worker/device\")");
  // Fails early, here, for a device string libtorch does not parse.
  (void)c10::Device(device);
  return {worker, device};
}

void awaitCreation(
    const ModuleRRef& module,
    const std::string& worker,
    const std::string& typeName) {
  try {
    module.confirmedAsync().wait();
  } catch (const rpc::RpcError& error) {
    if (error.code() != rpc::ErrorCode::kUnknownFunction) {
      throw;
    }
    throw rpc::RpcError(
        error.code(),
        error.worker(),
        error.function(),
        error.messageId(),
        "module type '" + typeName + "' is not registered on '" + worker +
            "' (register it there with torchrpc::nn::registerModule before "
            "start()): " +
            error.detail());
  }
}

} // namespace detail
} // namespace nn
} // namespace torchrpc
