#pragma once

// Private: includes the generated protobuf code. The values of a message;
// see Note [Wire format] in rpc/wire/envelope.h.

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <vector>

#include "proto/rpc/envelope.pb.h"
#include "torchrpc/rpc/options.h"
#include "torchrpc/rpc/value_extension.h"

namespace torchrpc {
namespace rpc {
namespace detail {

// Nesting deeper than this is refused (both ways).
constexpr int kMaxValueDepth = 64;

// Note [Sparse tensors on the wire]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A sparse COO tensor is one descriptor (layout SPARSE_COO: the values'
// dtype, the full sizes, sparse_dim, nnz, coalesced) and two transport
// tensors, its indices (int64 [sparse_dim, nnz]) and its values ([nnz] +
// sizes[sparse_dim:]), each contiguous. Everything that indexes tensors —
// Value.tensor_index, send and receive hooks — counts descriptors, so an
// upper layer sees the sparse tensor as one tensor (autograd records its
// send and recv edges like a dense one's).
// On receipt both parts are checked like dense tensors' bytes, then
// sparse_coo_tensor() checks every index against the sizes; the coalesced
// flag is believed only after the indices are seen to be sorted and unique.
// Sparse tensors travel from and to the CPU only.

// Encodes the values of one outgoing message. Tensors are collected in order;
// descriptors are written to the envelope given to finish().
class ValueEncoder {
 public:
  // deviceMap: where this message's tensors land at the receiver; nullptr
  // means CPU only. extensions may be nullptr.
  ValueEncoder(
      int64_t toWorker,
      const DeviceMap* deviceMap,
      const std::vector<ValueExtension>* extensions);

  // Throws RpcError(kBadArguments) for a value that cannot be sent (an
  // unsupported kind or dtype, a device without a device map entry).
  void encode(const c10::IValue& value, wire::Value* out);

  // The tensors as the caller gave them (not detached or compacted), one
  // per descriptor, in order: what send hooks see.
  const std::vector<at::Tensor>& originalTensors() const {
    return originals_;
  }

  // Writes the tensor descriptors into envelope and moves out the tensors to
  // give the transport (contiguous CPU tensors).
  std::vector<at::Tensor> finish(wire::Envelope* envelope) &&;

  // Call before encode(): builds the descriptors in the elements that
  // envelope's cleared tensors field kept, instead of allocating new ones
  // (Note [Recycled envelopes] in rpc/wire/recycled_envelope.h). finish()
  // must then get the same envelope.
  void reuseDescriptorsOf(wire::Envelope* envelope);

 private:
  void encodeAt(const c10::IValue& value, wire::Value* out, int depth);
  // Both return the tensor's descriptor index (what Value.tensor_index
  // names); a sparse tensor adds two transport tensors.
  uint32_t addTensor(const at::Tensor& tensor);
  uint32_t addSparseTensor(const at::Tensor& tensor);

  int64_t toWorker_;
  const DeviceMap* deviceMap_;
  const std::vector<ValueExtension>* extensions_;
  google::protobuf::RepeatedPtrField<wire::TensorDesc> descs_;
  // What the transport carries, in order.
  std::vector<at::Tensor> tensors_;
  // One per descriptor.
  std::vector<at::Tensor> originals_;
};

// Decodes the values of one incoming message.
class ValueDecoder {
 public:
  // Validates every descriptor against the wire tensors (kByte, 1-D, as the
  // transport delivers them) and rebuilds the typed tensors. Throws
  // RpcError(kMalformedMessage) on any mismatch.
  ValueDecoder(
      int64_t fromWorker,
      const wire::Envelope& envelope,
      std::vector<at::Tensor> wireTensors,
      const std::vector<ValueExtension>* extensions);

  // The rebuilt tensors, in descriptor order. Receive hooks may replace them
  // (same count) before values are decoded.
  std::vector<at::Tensor>& tensors() {
    return tensors_;
  }

  // Throws RpcError(kMalformedMessage) on anything invalid.
  c10::IValue decode(const wire::Value& value);

 private:
  c10::IValue decodeAt(const wire::Value& value, int depth);

  int64_t fromWorker_;
  const std::vector<ValueExtension>* extensions_;
  std::vector<at::Tensor> tensors_;
};

} // namespace detail
} // namespace rpc
} // namespace torchrpc
