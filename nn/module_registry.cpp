#include "torchrpc/nn/module_registry.h"

#include <vector>

namespace torchrpc {
namespace nn {
namespace detail {

void registerSharedFunctions(rpc::Runtime& runtime) {
  using Instance = c10::intrusive_ptr<ModuleInstance>;
  auto& functions = runtime.functions();
  if (functions.find(kParameters)) {
    return;
  }
  functions.add(kParameters, [](Instance instance) {
    return instance->parameters();
  });
  functions.add(kTrain, [](Instance instance, bool on) {
    instance->train(on);
  });
  functions.add(kSave, [](Instance instance, std::string path) {
    instance->save(path);
  });
  functions.add(kLoad, [](Instance instance, std::string path) {
    instance->load(path);
  });
  functions.add(kStateDict, [](Instance instance) {
    return instance->stateDict();
  });
}

} // namespace detail
} // namespace nn
} // namespace torchrpc
