#include "torchrpc/rpc/wire/value_codec.h"

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/jit_type.h>
#include <c10/core/DeviceType.h>
#include <c10/util/Exception.h>
#include <c10/util/FunctionRef.h>

#include <limits>
#include <sstream>
#include <utility>

#include "torchrpc/rpc/errors.h"

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

// The caller (agent, registry) knows the worker, function and message id and
// adds them when it turns this into a future's error; the codec does not.
[[noreturn]] void throwBadArguments(const std::string& detail) {
  throw RpcError(ErrorCode::kBadArguments, "", "", 0, detail);
}

[[noreturn]] void throwMalformed(const std::string& detail) {
  throw RpcError(ErrorCode::kMalformedMessage, "", "", 0, detail);
}

template <typename... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}

// The dtypes every worker can rebuild from raw bytes. Quantized and bit-packed
// types carry state (scales, packing) that raw bytes do not describe.
bool isWireDtype(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Bool:
    case c10::ScalarType::Byte:
    case c10::ScalarType::Char:
    case c10::ScalarType::Short:
    case c10::ScalarType::Int:
    case c10::ScalarType::Long:
    case c10::ScalarType::Half:
    case c10::ScalarType::BFloat16:
    case c10::ScalarType::Float:
    case c10::ScalarType::Double:
    case c10::ScalarType::ComplexFloat:
    case c10::ScalarType::ComplexDouble:
      return true;
    default:
      return false;
  }
}

// Dict keys must hash and compare the same on both workers, which rules out
// tensors (hashed by identity) and containers.
bool isDictKeyKind(c10::TypeKind kind) {
  return kind == c10::TypeKind::StringType || kind == c10::TypeKind::IntType ||
      kind == c10::TypeKind::BoolType || kind == c10::TypeKind::FloatType;
}

// NB: c10::Device has no operator<, so DeviceMap's ordering cannot be relied
// on here; device maps hold a handful of entries, so a scan is as fast.
const c10::Device* lookupDevice(
    const DeviceMap* deviceMap,
    const c10::Device& device) {
  if (deviceMap == nullptr) {
    return nullptr;
  }
  for (const auto& entry : *deviceMap) {
    if (entry.first == device) {
      return &entry.second;
    }
  }
  return nullptr;
}

// Whether value may be stored in a container declared to hold `type`. The
// common element kinds are checked on the tag alone, because IValue::type()
// allocates (a TensorType per tensor); containers fall back to the type
// system, which knows List invariance and Tuple covariance.
bool matchesType(const c10::IValue& value, const c10::Type& type) {
  switch (type.kind()) {
    case c10::TypeKind::AnyType:
      return true;
    case c10::TypeKind::TensorType:
      return value.isTensor();
    case c10::TypeKind::IntType:
      return value.isInt();
    case c10::TypeKind::FloatType:
      return value.isDouble();
    case c10::TypeKind::BoolType:
      return value.isBool();
    case c10::TypeKind::StringType:
      return value.isString();
    case c10::TypeKind::NoneType:
      return value.isNone();
    case c10::TypeKind::DeviceObjType:
      return value.isDevice();
    case c10::TypeKind::ComplexType:
      return value.isComplexDouble();
    case c10::TypeKind::NumberType:
      return value.isInt() || value.isDouble() || value.isComplexDouble();
    case c10::TypeKind::OptionalType:
      return value.isNone() ||
          matchesType(
                 value,
                 *type.expectRef<c10::OptionalType>().getElementType());
    default:
      return value.type()->isSubtypeOf(type);
  }
}

// Encodes the static type of a container's elements. Types the wire cannot
// name become ANY: the elements themselves still carry their kind.
void encodeType(const c10::Type& type, wire::TypeDesc* out, int depth) {
  if (depth >= kMaxValueDepth) {
    throwBadArguments(concat(
        "type ",
        type.repr_str(),
        " is nested deeper than ",
        kMaxValueDepth,
        " levels"));
  }
  switch (type.kind()) {
    case c10::TypeKind::AnyType:
      out->set_kind(wire::TypeDesc::ANY);
      return;
    case c10::TypeKind::TensorType:
      out->set_kind(wire::TypeDesc::TENSOR);
      return;
    case c10::TypeKind::IntType:
      out->set_kind(wire::TypeDesc::INT);
      return;
    case c10::TypeKind::FloatType:
      out->set_kind(wire::TypeDesc::FLOAT);
      return;
    case c10::TypeKind::BoolType:
      out->set_kind(wire::TypeDesc::BOOL);
      return;
    case c10::TypeKind::StringType:
      out->set_kind(wire::TypeDesc::STRING);
      return;
    case c10::TypeKind::NoneType:
      out->set_kind(wire::TypeDesc::NONE);
      return;
    case c10::TypeKind::DeviceObjType:
      out->set_kind(wire::TypeDesc::DEVICE);
      return;
    case c10::TypeKind::ComplexType:
      out->set_kind(wire::TypeDesc::COMPLEX);
      return;
    case c10::TypeKind::NumberType:
      out->set_kind(wire::TypeDesc::NUMBER);
      return;
    case c10::TypeKind::OptionalType:
      out->set_kind(wire::TypeDesc::OPTIONAL);
      encodeType(
          *type.expectRef<c10::OptionalType>().getElementType(),
          out->add_args(),
          depth + 1);
      return;
    case c10::TypeKind::ListType:
      out->set_kind(wire::TypeDesc::LIST);
      encodeType(
          *type.expectRef<c10::ListType>().getElementType(),
          out->add_args(),
          depth + 1);
      return;
    case c10::TypeKind::RRefType:
      out->set_kind(wire::TypeDesc::RREF);
      encodeType(
          *type.expectRef<c10::RRefType>().getElementType(),
          out->add_args(),
          depth + 1);
      return;
    case c10::TypeKind::TupleType: {
      out->set_kind(wire::TypeDesc::TUPLE);
      const auto& elements = type.expectRef<c10::TupleType>().elements();
      out->mutable_args()->Reserve(static_cast<int>(elements.size()));
      for (const auto& element : elements) {
        encodeType(*element, out->add_args(), depth + 1);
      }
      return;
    }
    case c10::TypeKind::DictType: {
      const auto& dictType = type.expectRef<c10::DictType>();
      if (!isDictKeyKind(dictType.getKeyType()->kind())) {
        throwBadArguments(concat(
            "cannot send a dict with keys of type ",
            dictType.getKeyType()->repr_str(),
            " (keys must be str, int, bool or float)"));
      }
      out->set_kind(wire::TypeDesc::DICT);
      encodeType(*dictType.getKeyType(), out->add_args(), depth + 1);
      encodeType(*dictType.getValueType(), out->add_args(), depth + 1);
      return;
    }
    default:
      out->set_kind(wire::TypeDesc::ANY);
      return;
  }
}

void expectArgs(const wire::TypeDesc& desc, int count) {
  if (desc.args_size() != count) {
    throwMalformed(concat(
        "type descriptor ",
        wire::TypeDesc::Kind_Name(desc.kind()),
        " has ",
        desc.args_size(),
        " type arguments, expected ",
        count));
  }
}

c10::TypePtr decodeType(const wire::TypeDesc& desc, int depth) {
  if (depth >= kMaxValueDepth) {
    throwMalformed(concat(
        "type descriptor nested deeper than ",
        kMaxValueDepth,
        " levels"));
  }
  switch (desc.kind()) {
    case wire::TypeDesc::ANY:
      expectArgs(desc, 0);
      return c10::AnyType::get();
    case wire::TypeDesc::TENSOR:
      expectArgs(desc, 0);
      return c10::TensorType::get();
    case wire::TypeDesc::INT:
      expectArgs(desc, 0);
      return c10::IntType::get();
    case wire::TypeDesc::FLOAT:
      expectArgs(desc, 0);
      return c10::FloatType::get();
    case wire::TypeDesc::BOOL:
      expectArgs(desc, 0);
      return c10::BoolType::get();
    case wire::TypeDesc::STRING:
      expectArgs(desc, 0);
      return c10::StringType::get();
    case wire::TypeDesc::NONE:
      expectArgs(desc, 0);
      return c10::NoneType::get();
    case wire::TypeDesc::DEVICE:
      expectArgs(desc, 0);
      return c10::DeviceObjType::get();
    case wire::TypeDesc::COMPLEX:
      expectArgs(desc, 0);
      return c10::ComplexType::get();
    case wire::TypeDesc::NUMBER:
      expectArgs(desc, 0);
      return c10::NumberType::get();
    case wire::TypeDesc::OPTIONAL: {
      expectArgs(desc, 1);
      auto element = decodeType(desc.args(0), depth + 1);
      // The sender's type system never produces these, and OptionalType's
      // constructor asserts on them.
      if (element->kind() == c10::TypeKind::OptionalType ||
          element->kind() == c10::TypeKind::NoneType) {
        throwMalformed(
            concat("type descriptor Optional[", element->repr_str(), "]"));
      }
      return c10::OptionalType::create(std::move(element));
    }
    case wire::TypeDesc::LIST:
      expectArgs(desc, 1);
      return c10::ListType::create(decodeType(desc.args(0), depth + 1));
    case wire::TypeDesc::RREF:
      expectArgs(desc, 1);
      return c10::RRefType::create(decodeType(desc.args(0), depth + 1));
    case wire::TypeDesc::TUPLE: {
      std::vector<c10::TypePtr> elements;
      elements.reserve(desc.args_size());
      for (const auto& arg : desc.args()) {
        elements.push_back(decodeType(arg, depth + 1));
      }
      return c10::TupleType::create(std::move(elements));
    }
    case wire::TypeDesc::DICT: {
      expectArgs(desc, 2);
      auto key = decodeType(desc.args(0), depth + 1);
      if (!isDictKeyKind(key->kind())) {
        throwMalformed(
            concat("dict key type ", key->repr_str(), " not allowed"));
      }
      return c10::DictType::create(
          std::move(key),
          decodeType(desc.args(1), depth + 1));
    }
    default:
      throwMalformed(concat(
          "unknown type descriptor kind ",
          static_cast<int>(desc.kind())));
  }
}

// c10::Device's constructor only debug-asserts its arguments, so everything a
// peer names is range-checked before one is built.
c10::Device decodeDevice(int32_t type, int32_t index, const char* what) {
  if (type < 0 || type >= c10::COMPILE_TIME_MAX_DEVICE_TYPES ||
      !c10::isValidDeviceType(static_cast<c10::DeviceType>(type))) {
    throwMalformed(concat(what, " has invalid device type ", type));
  }
  auto deviceType = static_cast<c10::DeviceType>(type);
  if (index < -1 || index > std::numeric_limits<c10::DeviceIndex>::max() ||
      (deviceType == c10::DeviceType::CPU && index > 0)) {
    throwMalformed(concat(
        what,
        " has invalid device index ",
        index,
        " for ",
        c10::DeviceTypeName(deviceType, /*lower_case=*/true)));
  }
  return c10::Device(deviceType, static_cast<c10::DeviceIndex>(index));
}

// Views the bytes the transport delivered as a contiguous tensor of `dtype`
// and `sizes`, without a copy. See Note [Wire format], guarantee 3. `what`
// names the tensor in an error; it is only called then, since building the
// name costs more than decoding a small tensor.
at::Tensor viewWireBytes(
    c10::function_ref<std::string()> what,
    c10::ScalarType dtype,
    c10::IntArrayRef sizes,
    const at::Tensor& wire) {
  if (!wire.defined() || wire.scalar_type() != at::kByte || wire.dim() != 1 ||
      !wire.device().is_cpu() || wire.layout() != at::kStrided ||
      wire.storage_offset() != 0 || !wire.is_contiguous()) {
    throwMalformed(concat(
        what(),
        ": the transport delivered ",
        wire.defined() ? wire.toString() : std::string("undefined"),
        ", expected a contiguous 1-D CPU byte tensor at offset 0"));
  }
  const int64_t itemSize = static_cast<int64_t>(c10::elementSize(dtype));

  // Contiguous strides; every size counts as at least 1 so that a tensor
  // with a zero dimension still has strides that cannot overflow.
  const int dims = static_cast<int>(sizes.size());
  at::DimVector strides(dims);
  int64_t extent = 1;
  int64_t numel = 1;
  for (int d = dims - 1; d >= 0; --d) {
    int64_t size = sizes[d];
    if (size < 0) {
      throwMalformed(concat(what(), ": negative size ", size));
    }
    strides[d] = extent;
    if (__builtin_mul_overflow(extent, std::max<int64_t>(size, 1), &extent)) {
      throwMalformed(concat(what(), ": sizes overflow"));
    }
    numel *= size; // Cannot overflow: numel <= extent.
  }
  int64_t extentBytes = 0;
  if (__builtin_mul_overflow(extent, itemSize, &extentBytes)) {
    throwMalformed(concat(what(), ": sizes overflow"));
  }
  const int64_t nbytes = numel * itemSize;
  if (nbytes != wire.numel()) {
    throwMalformed(concat(
        what(),
        ": descriptor needs ",
        nbytes,
        " bytes but ",
        wire.numel(),
        " arrived"));
  }

  // A CPU tensor on the wire tensor's storage, made directly: at::empty()
  // then set_(), two trips through the dispatcher, cost six times as much,
  // which for a small tensor was most of its decoding (bench/RESULTS.md).
  // The result is what set_() made: the same storage, dispatch keys and
  // autograd state.
  at::Tensor tensor = at::detail::make_tensor<c10::TensorImpl>(
      c10::Storage(wire.storage()),
      c10::DispatchKeySet(c10::DispatchKey::CPU),
      caffe2::TypeMeta::fromScalarType(dtype));
  tensor.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
  return tensor;
}

c10::ScalarType wireDtype(size_t i, const wire::TensorDesc& desc) {
  if (desc.dtype() >= static_cast<uint32_t>(c10::ScalarType::NumOptions) ||
      !isWireDtype(static_cast<c10::ScalarType>(desc.dtype()))) {
    throwMalformed(
        concat("tensor ", i, ": dtype ", desc.dtype(), " not allowed"));
  }
  return static_cast<c10::ScalarType>(desc.dtype());
}

void setRequiresGrad(size_t i, const wire::TensorDesc& desc, at::Tensor& t) {
  if (!desc.requires_grad()) {
    return;
  }
  const auto dtype = static_cast<c10::ScalarType>(desc.dtype());
  if (!c10::isFloatingType(dtype) && !c10::isComplexType(dtype)) {
    throwMalformed(concat(
        "tensor ",
        i,
        ": requires_grad set on dtype ",
        c10::toString(dtype)));
  }
  // Last, so that the received tensor is a leaf.
  t.set_requires_grad(true);
}

at::Tensor rebuildStrided(
    size_t i,
    const wire::TensorDesc& desc,
    const at::Tensor& wire) {
  at::Tensor tensor = viewWireBytes(
      [&] { return concat("tensor ", i); },
      wireDtype(i, desc),
      c10::IntArrayRef(desc.sizes().data(), desc.sizes_size()),
      wire);

  if (desc.device_type() != static_cast<int32_t>(c10::DeviceType::CPU)) {
    c10::Device device = decodeDevice(
        desc.device_type(),
        desc.device_index(),
        concat("tensor ", i).c_str());
    try {
      tensor = tensor.to(device);
    } catch (const std::exception& e) {
      throwMalformed(concat(
          "tensor ",
          i,
          " is meant for device ",
          device,
          ", which this worker cannot use: ",
          describeException(std::current_exception())));
    }
  }
  setRequiresGrad(i, desc, tensor);
  return tensor;
}

// True when the indices are sorted and unique, as a coalesced tensor's are
// (row-major order of the sparse dimensions).
bool indicesAreCoalesced(
    const at::Tensor& indices,
    c10::IntArrayRef sparseSizes) {
  const int64_t nnz = indices.size(1);
  if (nnz < 2) {
    return true;
  }
  // Cannot overflow: the product of all sizes was checked.
  at::Tensor linear = at::zeros({nnz}, indices.options());
  for (size_t d = 0; d < sparseSizes.size(); ++d) {
    linear.mul_(sparseSizes[d]).add_(indices[static_cast<int64_t>(d)]);
  }
  return (linear.slice(0, 1) > linear.slice(0, 0, nnz - 1)).all().item<bool>();
}

// See Note [Sparse tensors on the wire].
at::Tensor rebuildSparse(
    size_t i,
    const wire::TensorDesc& desc,
    const at::Tensor& wireIndices,
    const at::Tensor& wireValues) {
  if (desc.device_type() != static_cast<int32_t>(c10::DeviceType::CPU)) {
    throwMalformed(
        concat("tensor ", i, ": a sparse tensor must travel to the CPU"));
  }
  const auto dtype = wireDtype(i, desc);
  const c10::IntArrayRef sizes(desc.sizes().data(), desc.sizes_size());
  const int64_t sparseDim = desc.sparse_dim();
  const int64_t nnz = desc.nnz();
  if (sparseDim < 0 || sparseDim > static_cast<int64_t>(sizes.size()) ||
      nnz < 0) {
    throwMalformed(concat(
        "tensor ",
        i,
        ": sparse_dim ",
        sparseDim,
        " and nnz ",
        nnz,
        " do not fit sizes ",
        sizes));
  }
  int64_t numel = 1;
  for (int64_t size : sizes) {
    if (size < 0 || __builtin_mul_overflow(numel, size, &numel)) {
      throwMalformed(concat("tensor ", i, ": invalid sizes ", sizes));
    }
  }
  at::Tensor indices = viewWireBytes(
      [&] { return concat("tensor ", i, " (indices)"); },
      at::kLong,
      {sparseDim, nnz},
      wireIndices);
  std::vector<int64_t> valueSizes{nnz};
  valueSizes.insert(valueSizes.end(), sizes.begin() + sparseDim, sizes.end());
  at::Tensor values = viewWireBytes(
      [&] { return concat("tensor ", i, " (values)"); },
      dtype,
      valueSizes,
      wireValues);
  // sparse_coo_tensor with explicit sizes checks that every index is within
  // them; a peer's bad index becomes kMalformedMessage through the caller.
  at::Tensor tensor = at::sparse_coo_tensor(indices, values, sizes);
  if (desc.coalesced() &&
      indicesAreCoalesced(indices, sizes.slice(0, sparseDim))) {
    tensor._coalesced_(true);
  }
  setRequiresGrad(i, desc, tensor);
  return tensor;
}

// The conjugate and negative bits are lazy: the bytes do not include them.
at::Tensor resolveLazyBits(at::Tensor tensor) {
  if (tensor.is_conj()) {
    tensor = tensor.resolve_conj();
  }
  if (tensor.is_neg()) {
    tensor = tensor.resolve_neg();
  }
  return tensor;
}

} // namespace

ValueEncoder::ValueEncoder(
    int64_t toWorker,
    const DeviceMap* deviceMap,
    const std::vector<ValueExtension>* extensions)
    : toWorker_(toWorker),
      deviceMap_(deviceMap),
      extensions_(extensions) {}

void ValueEncoder::encode(const c10::IValue& value, wire::Value* out) {
  try {
    encodeAt(value, out, 0);
  } catch (const RpcError&) {
    throw;
  } catch (const std::exception&) {
    // A libtorch check (say, copying a tensor off its device) failed.
    throwBadArguments(describeException(std::current_exception()));
  }
}

std::vector<at::Tensor> ValueEncoder::finish(wire::Envelope* envelope) && {
  // Descriptor i must describe transport tensor i; anything already there
  // would shift the indices.
  envelope->clear_tensors();
  envelope->mutable_tensors()->Swap(&descs_);
  return std::move(tensors_);
}

void ValueEncoder::reuseDescriptorsOf(wire::Envelope* envelope) {
  TORCH_INTERNAL_ASSERT(descs_.empty(), "reuseDescriptorsOf after encode");
  envelope->clear_tensors();
  descs_.Swap(envelope->mutable_tensors());
}

void ValueEncoder::encodeAt(
    const c10::IValue& value,
    wire::Value* out,
    int depth) {
  if (depth >= kMaxValueDepth) {
    throwBadArguments(
        concat("value nested deeper than ", kMaxValueDepth, " levels"));
  }
  // Most frequent kinds first.
  if (value.isTensor()) {
    out->set_tensor_index(addTensor(value.toTensor()));
  } else if (value.isInt()) {
    out->set_int_value(value.toInt());
  } else if (value.isDouble()) {
    out->set_double_value(value.toDouble());
  } else if (value.isBool()) {
    out->set_bool_value(value.toBool());
  } else if (value.isNone()) {
    out->mutable_none();
  } else if (value.isString()) {
    out->set_string_value(value.toStringRef());
  } else if (value.isList()) {
    auto list = value.toList();
    const auto elementType = list.elementType();
    auto* wireList = out->mutable_list();
    encodeType(*elementType, wireList->mutable_element_type(), depth + 1);
    auto* elements = wireList->mutable_elements();
    elements->Reserve(static_cast<int>(list.size()));
    for (const c10::IValue& element : value.toListRef()) {
      // The receiver refuses a mistyped element as a malformed message (and
      // drops the connection), so catch the caller's mistake here.
      if (!matchesType(element, *elementType)) {
        throwBadArguments(concat(
            "list declared as List[",
            elementType->repr_str(),
            "] holds a value of type ",
            element.tagKind()));
      }
      encodeAt(element, elements->Add(), depth + 1);
    }
  } else if (value.isTuple()) {
    const auto& elements = value.toTupleRef().elements();
    auto* wireElements = out->mutable_tuple()->mutable_elements();
    wireElements->Reserve(static_cast<int>(elements.size()));
    for (const c10::IValue& element : elements) {
      encodeAt(element, wireElements->Add(), depth + 1);
    }
  } else if (value.isGenericDict()) {
    auto dict = value.toGenericDict();
    const auto keyType = dict.keyType();
    const auto valueType = dict.valueType();
    auto* wireDict = out->mutable_dict();
    if (!isDictKeyKind(keyType->kind())) {
      throwBadArguments(concat(
          "cannot send a dict with keys of type ",
          keyType->repr_str(),
          " (keys must be str, int, bool or float)"));
    }
    encodeType(*keyType, wireDict->mutable_key_type(), depth + 1);
    encodeType(*valueType, wireDict->mutable_value_type(), depth + 1);
    auto* entries = wireDict->mutable_entries();
    entries->Reserve(static_cast<int>(dict.size()));
    for (const auto& entry : dict) {
      if (!matchesType(entry.key(), *keyType) ||
          !matchesType(entry.value(), *valueType)) {
        throwBadArguments(concat(
            "dict declared as Dict[",
            keyType->repr_str(),
            ", ",
            valueType->repr_str(),
            "] holds an entry of types ",
            entry.key().tagKind(),
            ", ",
            entry.value().tagKind()));
      }
      auto* wireEntry = entries->Add();
      encodeAt(entry.key(), wireEntry->mutable_key(), depth + 1);
      encodeAt(entry.value(), wireEntry->mutable_value(), depth + 1);
    }
  } else if (value.isComplexDouble()) {
    auto complex = value.toComplexDouble();
    auto* wireComplex = out->mutable_complex_value();
    wireComplex->set_real(complex.real());
    wireComplex->set_imag(complex.imag());
  } else if (value.isDevice()) {
    auto device = value.toDevice();
    auto* wireDevice = out->mutable_device();
    wireDevice->set_type(static_cast<int32_t>(device.type()));
    wireDevice->set_index(device.index());
  } else {
    // Extensions are asked only here, so values the codec knows never pay
    // for their matches().
    if (extensions_ != nullptr) {
      for (const ValueExtension& extension : *extensions_) {
        if (!extension.matches(value)) {
          continue;
        }
        auto* wireExtension = out->mutable_extension();
        wireExtension->set_kind(extension.kind);
        std::vector<c10::IValue> nested;
        extension.encode(
            value,
            toWorker_,
            wireExtension->mutable_payload(),
            &nested);
        auto* wireValues = wireExtension->mutable_values();
        wireValues->Reserve(static_cast<int>(nested.size()));
        for (const c10::IValue& element : nested) {
          encodeAt(element, wireValues->Add(), depth + 1);
        }
        return;
      }
    }
    throwBadArguments(concat("cannot send a value of type ", value.tagKind()));
  }
}

uint32_t ValueEncoder::addTensor(const at::Tensor& tensor) {
  if (!tensor.defined()) {
    throwBadArguments("cannot send an undefined tensor");
  }
  if (tensor.layout() == at::kSparse) {
    return addSparseTensor(tensor);
  }
  if (tensor.layout() != at::kStrided || tensor.is_nested()) {
    throwBadArguments(concat(
        "cannot send a tensor with layout ",
        tensor.is_nested() ? std::string("nested") : c10::str(tensor.layout()),
        " (only strided and sparse COO tensors)"));
  }
  const auto dtype = tensor.scalar_type();
  if (!isWireDtype(dtype)) {
    throwBadArguments(
        concat("cannot send a tensor of dtype ", c10::toString(dtype)));
  }
  if (descs_.size() == std::numeric_limits<int>::max()) {
    throwBadArguments("too many tensors in one message");
  }

  const c10::Device device = tensor.device();
  const c10::Device* target = lookupDevice(deviceMap_, device);
  if (target == nullptr && !device.is_cpu()) {
    throwBadArguments(concat(
        "cannot send a tensor on device ",
        device,
        ": the device map has no entry for it"));
  }

  // detach(): the transport only needs the bytes, and the autograd layer
  // records edges from the caller's tensor, not from this one. A tensor
  // that does not require grad has no edge to cut, and detaching it would
  // cost a TensorImpl per call.
  at::Tensor wire =
      resolveLazyBits(tensor.requires_grad() ? tensor.detach() : tensor);
  if (!device.is_cpu()) {
    wire = wire.to(
        at::kCPU,
        /*non_blocking=*/false,
        /*copy=*/false,
        at::MemoryFormat::Contiguous);
  } else if (!wire.is_contiguous()) {
    wire = wire.contiguous();
  }

  wire::TensorDesc& desc = *descs_.Add();
  desc.set_dtype(static_cast<uint32_t>(dtype));
  const auto sizes = tensor.sizes();
  desc.mutable_sizes()->Add(sizes.begin(), sizes.end());
  desc.set_requires_grad(tensor.requires_grad());
  if (target != nullptr) {
    desc.set_device_type(static_cast<int32_t>(target->type()));
    desc.set_device_index(target->index());
  } else {
    desc.set_device_type(static_cast<int32_t>(c10::DeviceType::CPU));
    desc.set_device_index(-1);
  }
  tensors_.push_back(std::move(wire));
  // Send hooks (autograd) record edges from the caller's own tensors.
  originals_.push_back(tensor);
  return static_cast<uint32_t>(descs_.size() - 1);
}

uint32_t ValueEncoder::addSparseTensor(const at::Tensor& tensor) {
  if (!tensor.device().is_cpu()) {
    throwBadArguments(concat(
        "cannot send a sparse tensor on device ",
        tensor.device(),
        " (sparse tensors travel from the CPU only)"));
  }
  const auto dtype = tensor.scalar_type();
  if (!isWireDtype(dtype)) {
    throwBadArguments(
        concat("cannot send a tensor of dtype ", c10::toString(dtype)));
  }
  if (descs_.size() == std::numeric_limits<int>::max()) {
    throwBadArguments("too many tensors in one message");
  }
  // See Note [Sparse tensors on the wire]: indices then values, each as a
  // contiguous strided tensor; the descriptor carries the rest.
  const at::Tensor detached = tensor.detach();
  at::Tensor indices = detached._indices().contiguous();
  at::Tensor values = resolveLazyBits(detached._values()).contiguous();

  wire::TensorDesc& desc = *descs_.Add();
  desc.set_layout(wire::TensorDesc::SPARSE_COO);
  desc.set_dtype(static_cast<uint32_t>(dtype));
  const auto sizes = tensor.sizes();
  desc.mutable_sizes()->Add(sizes.begin(), sizes.end());
  desc.set_requires_grad(tensor.requires_grad());
  desc.set_device_type(static_cast<int32_t>(c10::DeviceType::CPU));
  desc.set_device_index(-1);
  desc.set_sparse_dim(detached.sparse_dim());
  desc.set_nnz(detached._nnz());
  desc.set_coalesced(detached.is_coalesced());
  tensors_.push_back(std::move(indices));
  tensors_.push_back(std::move(values));
  originals_.push_back(tensor);
  return static_cast<uint32_t>(descs_.size() - 1);
}

ValueDecoder::ValueDecoder(
    int64_t fromWorker,
    const wire::Envelope& envelope,
    std::vector<at::Tensor> wireTensors,
    const std::vector<ValueExtension>* extensions)
    : fromWorker_(fromWorker),
      extensions_(extensions) {
  const auto& descs = envelope.tensors();
  size_t expected = 0;
  for (const auto& desc : descs) {
    expected += desc.layout() == wire::TensorDesc::SPARSE_COO ? 2 : 1;
  }
  if (expected != wireTensors.size()) {
    throwMalformed(concat(
        "envelope describes ",
        descs.size(),
        " tensors",
        expected == static_cast<size_t>(descs.size())
            ? std::string()
            : concat(" in ", expected, " transport tensors"),
        " but ",
        wireTensors.size(),
        " arrived"));
  }
  tensors_.reserve(descs.size());
  try {
    size_t next = 0;
    for (int i = 0; i < descs.size(); ++i) {
      const auto& desc = descs[i];
      switch (desc.layout()) {
        case wire::TensorDesc::STRIDED:
          tensors_.push_back(rebuildStrided(i, desc, wireTensors[next]));
          next += 1;
          break;
        case wire::TensorDesc::SPARSE_COO:
          tensors_.push_back(
              rebuildSparse(i, desc, wireTensors[next], wireTensors[next + 1]));
          next += 2;
          break;
        default:
          throwMalformed(
              concat("tensor ", i, ": unknown layout ", desc.layout()));
      }
    }
  } catch (const RpcError&) {
    throw;
  } catch (const std::exception&) {
    throwMalformed(describeException(std::current_exception()));
  }
}

c10::IValue ValueDecoder::decode(const wire::Value& value) {
  try {
    return decodeAt(value, 0);
  } catch (const RpcError&) {
    throw;
  } catch (const std::exception&) {
    // A libtorch check on a value the peer made up.
    throwMalformed(describeException(std::current_exception()));
  }
}

c10::IValue ValueDecoder::decodeAt(const wire::Value& value, int depth) {
  if (depth >= kMaxValueDepth) {
    throwMalformed(
        concat("value nested deeper than ", kMaxValueDepth, " levels"));
  }
  switch (value.kind_case()) {
    case wire::Value::kNone:
      return c10::IValue();
    case wire::Value::kBoolValue:
      return c10::IValue(value.bool_value());
    case wire::Value::kIntValue:
      return c10::IValue(static_cast<int64_t>(value.int_value()));
    case wire::Value::kDoubleValue:
      return c10::IValue(value.double_value());
    case wire::Value::kStringValue:
      return c10::IValue(value.string_value());
    case wire::Value::kTensorIndex: {
      const uint32_t index = value.tensor_index();
      if (index >= tensors_.size()) {
        throwMalformed(concat(
            "tensor index ",
            index,
            " out of range (",
            tensors_.size(),
            " tensors)"));
      }
      return c10::IValue(tensors_[index]);
    }
    case wire::Value::kList: {
      const auto& wireList = value.list();
      auto elementType = decodeType(wireList.element_type(), depth + 1);
      c10::impl::GenericList list(elementType);
      list.reserve(wireList.elements_size());
      for (const auto& wireElement : wireList.elements()) {
        c10::IValue element = decodeAt(wireElement, depth + 1);
        if (!matchesType(element, *elementType)) {
          throwMalformed(concat(
              "list declared as List[",
              elementType->repr_str(),
              "] holds a value of type ",
              element.tagKind()));
        }
        list.push_back(std::move(element));
      }
      return c10::IValue(std::move(list));
    }
    case wire::Value::kTuple: {
      const auto& wireElements = value.tuple().elements();
      std::vector<c10::IValue> elements;
      elements.reserve(wireElements.size());
      for (const auto& wireElement : wireElements) {
        elements.push_back(decodeAt(wireElement, depth + 1));
      }
      return c10::IValue(c10::ivalue::Tuple::create(std::move(elements)));
    }
    case wire::Value::kDict: {
      const auto& wireDict = value.dict();
      auto keyType = decodeType(wireDict.key_type(), depth + 1);
      if (!isDictKeyKind(keyType->kind())) {
        throwMalformed(
            concat("dict key type ", keyType->repr_str(), " not allowed"));
      }
      auto valueType = decodeType(wireDict.value_type(), depth + 1);
      c10::impl::GenericDict dict(keyType, valueType);
      dict.reserve(wireDict.entries_size());
      for (const auto& wireEntry : wireDict.entries()) {
        c10::IValue key = decodeAt(wireEntry.key(), depth + 1);
        c10::IValue entryValue = decodeAt(wireEntry.value(), depth + 1);
        if (!matchesType(key, *keyType) ||
            !matchesType(entryValue, *valueType)) {
          throwMalformed(concat(
              "dict declared as Dict[",
              keyType->repr_str(),
              ", ",
              valueType->repr_str(),
              "] holds an entry of types ",
              key.tagKind(),
              ", ",
              entryValue.tagKind()));
        }
        if (!dict.insert(std::move(key), std::move(entryValue)).second) {
          throwMalformed("dict holds a duplicate key");
        }
      }
      return c10::IValue(std::move(dict));
    }
    case wire::Value::kComplexValue:
      return c10::IValue(c10::complex<double>(
          value.complex_value().real(),
          value.complex_value().imag()));
    case wire::Value::kDevice:
      return c10::IValue(decodeDevice(
          value.device().type(),
          value.device().index(),
          "device value"));
    case wire::Value::kExtension: {
      const auto& wireExtension = value.extension();
      const ValueExtension* extension = nullptr;
      if (extensions_ != nullptr) {
        for (const ValueExtension& candidate : *extensions_) {
          if (candidate.kind == wireExtension.kind()) {
            extension = &candidate;
            break;
          }
        }
      }
      if (extension == nullptr) {
        throwMalformed(
            concat("unknown extension kind '", wireExtension.kind(), "'"));
      }
      std::vector<c10::IValue> nested;
      nested.reserve(wireExtension.values_size());
      for (const auto& wireNested : wireExtension.values()) {
        nested.push_back(decodeAt(wireNested, depth + 1));
      }
      try {
        return extension->decode(
            fromWorker_,
            wireExtension.payload(),
            std::move(nested));
      } catch (...) {
        throwMalformed(concat(
            "extension '",
            extension->kind,
            "' could not decode its value: ",
            describeException(std::current_exception())));
      }
    }
    case wire::Value::KIND_NOT_SET:
      break;
  }
  throwMalformed("value has no kind set");
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
