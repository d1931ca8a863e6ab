#pragma once

#include <ATen/core/ivalue.h>

#include <functional>
#include <string>
#include <vector>

namespace torchrpc {
namespace rpc {

// Lets an upper layer send a kind of value the codec does not know (an RRef,
// a custom class). The codec asks each registered extension, in order,
// whether it `matches` a value; the first that does encodes it as opaque
// payload bytes plus nested values, which the codec encodes itself (so
// tensors inside still travel out of band). On the receiving worker the
// extension with the same `kind` rebuilds the value.
//
// decode may throw; the codec turns that into kMalformedMessage.
struct ValueExtension {
  std::string kind;
  std::function<bool(const c10::IValue&)> matches;
  // toWorker: the id of the worker the value is sent to.
  std::function<void(
      const c10::IValue& value,
      int64_t toWorker,
      std::string* payload,
      std::vector<c10::IValue>* nested)>
      encode;
  // fromWorker: the id of the worker that sent the value.
  std::function<c10::IValue(
      int64_t fromWorker,
      const std::string& payload,
      std::vector<c10::IValue>&& nested)>
      decode;
};

} // namespace rpc
} // namespace torchrpc
