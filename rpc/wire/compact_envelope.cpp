#include "torchrpc/rpc/wire/compact_envelope.h"

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "proto/rpc/envelope.pb.h"

namespace torchrpc {
namespace rpc {
namespace detail {

namespace {

// See Note [Compact envelopes].
constexpr uint8_t kFlagResponse = 1;
constexpr uint8_t kFlagTraced = 2;
constexpr uint8_t kKnownFlags = kFlagResponse | kFlagTraced;

enum Tag : uint8_t {
  kTagNone = 1,
  kTagBool = 2,
  kTagInt = 3,
  kTagDouble = 4,
  kTagBytes = 5,
  kTagTensorIndex = 6,
};

// The layout is little-endian; such a host copies fields as they are.
constexpr bool kLittleEndian = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;

constexpr size_t kMaxCount = std::numeric_limits<uint8_t>::max();
constexpr size_t kMaxLength = std::numeric_limits<uint32_t>::max();

// Marker, version, flags, kind, id, from_worker, timeout_ms, body length,
// and the three counts.
constexpr size_t kFixedBytes = 1 + 4 + 1 + 4 + 8 + 8 + 8 + 4 + 3;
// dtype, requires_grad, device type and index, dimension count.
constexpr size_t kDescriptorBytes = 1 + 1 + 4 + 4 + 1;

bool isMetadataKey(const std::string& key) {
  if (key.size() > kMaxCount) {
    return false;
  }
  for (char c : key) {
    if (c < 0x20 || c > 0x7e) {
      return false;
    }
  }
  return true;
}

// Kept by protobuf's parser for fields this build does not know; the
// generated classes of this protobuf reach them through reflection only.
bool hasUnknownFields(const google::protobuf::Message& message) {
  return !message.GetReflection()->GetUnknownFields(message).empty();
}

// The bytes `envelope` takes compactly, or 0 when it does not fit.
size_t compactSize(const wire::Envelope& envelope) {
  // Fields this build does not know (an envelope parsed from a newer peer's
  // protobuf) have no place in the layout.
  if (hasUnknownFields(envelope) || envelope.has_status() ||
      envelope.body().size() > kMaxLength ||
      static_cast<size_t>(envelope.metadata_size()) > kMaxCount ||
      static_cast<size_t>(envelope.tensors_size()) > kMaxCount ||
      static_cast<size_t>(envelope.values_size()) > kMaxCount) {
    return 0;
  }
  size_t size = kFixedBytes + envelope.body().size();
  for (const auto& entry : envelope.metadata()) {
    if (!isMetadataKey(entry.first) || entry.second.size() > kMaxLength) {
      return 0;
    }
    size += 1 + entry.first.size() + 4 + entry.second.size();
  }
  for (const auto& tensor : envelope.tensors()) {
    if (hasUnknownFields(tensor) ||
        tensor.layout() != wire::TensorDesc::STRIDED ||
        tensor.sparse_dim() != 0 || tensor.nnz() != 0 || tensor.coalesced() ||
        tensor.dtype() > kMaxCount ||
        static_cast<size_t>(tensor.sizes_size()) > kMaxCount) {
      return 0;
    }
    size += kDescriptorBytes + 8 * static_cast<size_t>(tensor.sizes_size());
  }
  for (const auto& value : envelope.values()) {
    if (hasUnknownFields(value)) {
      return 0;
    }
    switch (value.kind_case()) {
      case wire::Value::kNone:
        if (hasUnknownFields(value.none())) {
          return 0;
        }
        size += 1;
        break;
      case wire::Value::kBoolValue:
        size += 2;
        break;
      case wire::Value::kIntValue:
      case wire::Value::kDoubleValue:
        size += 9;
        break;
      case wire::Value::kStringValue:
        if (value.string_value().size() > kMaxLength) {
          return 0;
        }
        size += 5 + value.string_value().size();
        break;
      case wire::Value::kTensorIndex:
        size += 5;
        break;
      default:
        return 0;
    }
  }
  return size;
}

class Writer {
 public:
  explicit Writer(char* at) : at_(at) {}

  template <typename T>
  void put(T value) {
    static_assert(std::is_integral<T>::value, "integers only");
    if constexpr (kLittleEndian) {
      std::memcpy(at_, &value, sizeof(T));
      at_ += sizeof(T);
    } else {
      using U = std::make_unsigned_t<T>;
      U bits = static_cast<U>(value);
      for (size_t i = 0; i < sizeof(T); ++i) {
        *at_++ = static_cast<char>((bits >> (8 * i)) & 0xff);
      }
    }
  }

  void putDouble(double value) {
    uint64_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    put(bits);
  }

  void putBytes(const std::string& bytes) {
    if (!bytes.empty()) {
      std::memcpy(at_, bytes.data(), bytes.size());
    }
    at_ += bytes.size();
  }

  char* at() const {
    return at_;
  }

 private:
  char* at_;
};

// Reads the layout of Note [Compact envelopes]; every get fails (and stays
// failed) rather than read past the end.
class Reader {
 public:
  Reader(const char* data, size_t size) : at_(data), left_(size) {}

  template <typename T>
  bool get(T* value) {
    static_assert(std::is_integral<T>::value, "integers only");
    if (left_ < sizeof(T)) {
      return false;
    }
    if constexpr (kLittleEndian) {
      std::memcpy(value, at_, sizeof(T));
    } else {
      using U = std::make_unsigned_t<T>;
      U bits = 0;
      for (size_t i = 0; i < sizeof(T); ++i) {
        bits |= static_cast<U>(static_cast<uint8_t>(at_[i])) << (8 * i);
      }
      *value = static_cast<T>(bits);
    }
    at_ += sizeof(T);
    left_ -= sizeof(T);
    return true;
  }

  bool getBool(bool* value) {
    uint8_t byte;
    if (!get(&byte) || byte > 1) {
      return false;
    }
    *value = byte == 1;
    return true;
  }

  bool getDouble(double* value) {
    uint64_t bits;
    if (!get(&bits)) {
      return false;
    }
    std::memcpy(value, &bits, sizeof(bits));
    return true;
  }

  // `length` bytes into *out.
  bool getBytes(size_t length, std::string* out) {
    if (left_ < length) {
      return false;
    }
    out->assign(at_, length);
    at_ += length;
    left_ -= length;
    return true;
  }

  template <typename Length>
  bool getSized(std::string* out) {
    Length length;
    return get(&length) && getBytes(length, out);
  }

  size_t left() const {
    return left_;
  }

  bool atEnd() const {
    return left_ == 0;
  }

 private:
  const char* at_;
  size_t left_;
};

bool readValue(Reader& in, wire::Value* value) {
  uint8_t tag;
  if (!in.get(&tag)) {
    return false;
  }
  switch (tag) {
    case kTagNone:
      value->mutable_none();
      return true;
    case kTagBool: {
      bool b;
      if (!in.getBool(&b)) {
        return false;
      }
      value->set_bool_value(b);
      return true;
    }
    case kTagInt: {
      int64_t i;
      if (!in.get(&i)) {
        return false;
      }
      value->set_int_value(i);
      return true;
    }
    case kTagDouble: {
      double d;
      if (!in.getDouble(&d)) {
        return false;
      }
      value->set_double_value(d);
      return true;
    }
    case kTagBytes:
      return in.getSized<uint32_t>(value->mutable_string_value());
    case kTagTensorIndex: {
      uint32_t index;
      if (!in.get(&index)) {
        return false;
      }
      value->set_tensor_index(index);
      return true;
    }
    default:
      return false;
  }
}

bool readDescriptor(Reader& in, wire::TensorDesc* tensor) {
  uint8_t dtype;
  bool requiresGrad;
  int32_t deviceType;
  int32_t deviceIndex;
  uint8_t dims;
  if (!in.get(&dtype) || !in.getBool(&requiresGrad) || !in.get(&deviceType) ||
      !in.get(&deviceIndex) || !in.get(&dims)) {
    return false;
  }
  tensor->set_dtype(dtype);
  tensor->set_requires_grad(requiresGrad);
  tensor->set_device_type(deviceType);
  tensor->set_device_index(deviceIndex);
  // Reserved only once the bytes are there: what the reader allocates
  // stays proportional to what it was sent.
  if (in.left() < 8 * size_t(dims)) {
    return false;
  }
  auto* sizes = tensor->mutable_sizes();
  sizes->Reserve(dims);
  for (uint8_t d = 0; d < dims; ++d) {
    int64_t size;
    if (!in.get(&size)) {
      return false;
    }
    sizes->AddAlreadyReserved(size);
  }
  return true;
}

} // namespace

bool writeCompactEnvelope(const wire::Envelope& envelope, std::string* out) {
  const size_t size = compactSize(envelope);
  if (size == 0) {
    return false;
  }
  out->resize(size);
  Writer w(&(*out)[0]);
  w.put(uint8_t{0});
  w.put(envelope.version());
  w.put(static_cast<uint8_t>(
      (envelope.is_response() ? kFlagResponse : 0) |
      (envelope.traced() ? kFlagTraced : 0)));
  w.put(envelope.kind());
  w.put(envelope.id());
  w.put(envelope.from_worker());
  w.put(envelope.timeout_ms());
  w.put(static_cast<uint32_t>(envelope.body().size()));
  w.putBytes(envelope.body());
  w.put(static_cast<uint8_t>(envelope.metadata_size()));
  for (const auto& entry : envelope.metadata()) {
    w.put(static_cast<uint8_t>(entry.first.size()));
    w.putBytes(entry.first);
    w.put(static_cast<uint32_t>(entry.second.size()));
    w.putBytes(entry.second);
  }
  w.put(static_cast<uint8_t>(envelope.tensors_size()));
  for (const auto& tensor : envelope.tensors()) {
    w.put(static_cast<uint8_t>(tensor.dtype()));
    w.put(static_cast<uint8_t>(tensor.requires_grad() ? 1 : 0));
    w.put(tensor.device_type());
    w.put(tensor.device_index());
    w.put(static_cast<uint8_t>(tensor.sizes_size()));
    for (int64_t dim : tensor.sizes()) {
      w.put(dim);
    }
  }
  w.put(static_cast<uint8_t>(envelope.values_size()));
  for (const auto& value : envelope.values()) {
    switch (value.kind_case()) {
      case wire::Value::kNone:
        w.put(uint8_t{kTagNone});
        break;
      case wire::Value::kBoolValue:
        w.put(uint8_t{kTagBool});
        w.put(static_cast<uint8_t>(value.bool_value() ? 1 : 0));
        break;
      case wire::Value::kIntValue:
        w.put(uint8_t{kTagInt});
        w.put(value.int_value());
        break;
      case wire::Value::kDoubleValue:
        w.put(uint8_t{kTagDouble});
        w.putDouble(value.double_value());
        break;
      case wire::Value::kStringValue:
        w.put(uint8_t{kTagBytes});
        w.put(static_cast<uint32_t>(value.string_value().size()));
        w.putBytes(value.string_value());
        break;
      case wire::Value::kTensorIndex:
        w.put(uint8_t{kTagTensorIndex});
        w.put(value.tensor_index());
        break;
      default:
        // compactSize() declined every other kind.
        return false;
    }
  }
  return w.at() == out->data() + out->size();
}

bool readCompactEnvelope(
    const char* data,
    size_t size,
    wire::Envelope* envelope) {
  Reader in(data, size);
  uint8_t marker;
  uint32_t version;
  uint8_t flags;
  uint32_t kind;
  uint64_t id;
  int64_t fromWorker;
  uint64_t timeoutMs;
  if (!in.get(&marker) || marker != 0 || !in.get(&version) || !in.get(&flags) ||
      (flags & ~kKnownFlags) != 0 || !in.get(&kind) || !in.get(&id) ||
      !in.get(&fromWorker) || !in.get(&timeoutMs) ||
      !in.getSized<uint32_t>(envelope->mutable_body())) {
    return false;
  }
  envelope->set_version(version);
  envelope->set_is_response((flags & kFlagResponse) != 0);
  envelope->set_traced((flags & kFlagTraced) != 0);
  envelope->set_kind(kind);
  envelope->set_id(id);
  envelope->set_from_worker(fromWorker);
  envelope->set_timeout_ms(timeoutMs);

  uint8_t count;
  if (!in.get(&count)) {
    return false;
  }
  auto* metadata = count > 0 ? envelope->mutable_metadata() : nullptr;
  for (uint8_t i = 0; i < count; ++i) {
    std::string key;
    if (!in.getSized<uint8_t>(&key) || !isMetadataKey(key) ||
        metadata->count(key) != 0 ||
        !in.getSized<uint32_t>(&(*metadata)[key])) {
      return false;
    }
  }

  if (!in.get(&count)) {
    return false;
  }
  for (uint8_t i = 0; i < count; ++i) {
    if (!readDescriptor(in, envelope->add_tensors())) {
      return false;
    }
  }

  if (!in.get(&count)) {
    return false;
  }
  for (uint8_t i = 0; i < count; ++i) {
    if (!readValue(in, envelope->add_values())) {
      return false;
    }
  }
  return in.atEnd();
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
