#include "torchrpc/rpc/function_registry.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace torchrpc {
namespace rpc {

void FunctionRegistry::addBoxed(RegisteredFunction function) {
  TORCH_CHECK(!function.name.empty(), "a function name must not be empty");
  TORCH_CHECK(function.invoke, "function '", function.name, "' has no body");
  std::lock_guard<std::mutex> guard(mutex_);
  auto name = function.name;
  bool inserted =
      functions_
          .emplace(
              name,
              std::make_shared<const RegisteredFunction>(std::move(function)))
          .second;
  TORCH_CHECK(inserted, "function '", name, "' is already registered");
}

std::shared_ptr<const RegisteredFunction> FunctionRegistry::find(
    const std::string& name) const {
  std::lock_guard<std::mutex> guard(mutex_);
  auto it = functions_.find(name);
  return it == functions_.end() ? nullptr : it->second;
}

std::vector<std::string> FunctionRegistry::names() const {
  std::vector<std::string> out;
  {
    std::lock_guard<std::mutex> guard(mutex_);
    out.reserve(functions_.size());
    for (const auto& entry : functions_) {
      out.push_back(entry.first);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

} // namespace rpc
} // namespace torchrpc
