#pragma once

// Conversions between C++ values and c10::IValue, with the type checks that
// make a mismatched call a clear error instead of a crash. Used by the
// function registry (arguments, results of registered functions) and by the
// typed call API (arguments, results at the caller).

#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

namespace torchrpc {
namespace rpc {

template <typename T>
class Future;

namespace detail {

// How a C++ type travels as an IValue: its static c10 type (for checks and
// messages) and the conversion from an IValue already checked against it.
// Specialized where libtorch's own getTypePtr/to<T> have no mapping (narrow
// integers, float) or where we accept a promotion (int -> float).
template <typename T, typename Enable = void>
struct ValueTraits {
  static c10::TypePtr type() {
    return c10::getTypePtrCopy<T>();
  }
  static bool accepts(const c10::IValue& value) {
    return value.type()->isSubtypeOf(*type());
  }
  static T from(c10::IValue&& value) {
    return std::move(value).to<T>();
  }
};

template <>
struct ValueTraits<c10::IValue> {
  static c10::TypePtr type() {
    return c10::AnyType::get();
  }
  static bool accepts(const c10::IValue&) {
    return true;
  }
  static c10::IValue from(c10::IValue&& value) {
    return std::move(value);
  }
};

// Every integer type but bool and int64_t travels as an int.
template <typename T>
struct ValueTraits<
    T,
    std::enable_if_t<
        std::is_integral<T>::value && !std::is_same<T, bool>::value &&
        !std::is_same<T, int64_t>::value>> {
  static c10::TypePtr type() {
    return c10::IntType::get();
  }
  static bool accepts(const c10::IValue& value) {
    return value.isInt();
  }
  static T from(c10::IValue&& value) {
    return static_cast<T>(value.toInt());
  }
};

// Floating parameters also take ints, as Python callers would expect.
template <typename T>
struct ValueTraits<T, std::enable_if_t<std::is_floating_point<T>::value>> {
  static c10::TypePtr type() {
    return c10::FloatType::get();
  }
  static bool accepts(const c10::IValue& value) {
    return value.isDouble() || value.isInt();
  }
  static T from(c10::IValue&& value) {
    return static_cast<T>(value.isInt() ? value.toInt() : value.toDouble());
  }
};

// An upper layer's value type (an RRef) converts itself by giving its
// ValueTraits a static toIValue(const T&).
template <typename T, typename = void>
struct HasToIValue : std::false_type {};
template <typename T>
struct HasToIValue<
    T,
    std::void_t<decltype(ValueTraits<T>::toIValue(std::declval<const T&>()))>>
    : std::true_type {};

// Converts an argument or a result to an IValue.
template <typename T>
c10::IValue toIValue(T&& value) {
  using D = std::decay_t<T>;
  if constexpr (HasToIValue<D>::value) {
    return ValueTraits<D>::toIValue(value);
  } else if constexpr (std::is_same<D, c10::IValue>::value) {
    return std::forward<T>(value);
  } else if constexpr (std::is_same<D, bool>::value) {
    return c10::IValue(static_cast<bool>(value));
  } else if constexpr (std::is_integral<D>::value) {
    return c10::IValue(static_cast<int64_t>(value));
  } else if constexpr (std::is_floating_point<D>::value) {
    return c10::IValue(static_cast<double>(value));
  } else if constexpr (
      std::is_same<D, const char*>::value || std::is_same<D, char*>::value) {
    return c10::IValue(std::string(value));
  } else {
    return c10::IValue(std::forward<T>(value));
  }
}

// The name of a value's type, for error messages.
inline std::string typeName(const c10::IValue& value) {
  return value.type()->annotation_str();
}

template <typename T>
std::string typeName() {
  return ValueTraits<std::decay_t<T>>::type()->annotation_str();
}

} // namespace detail
} // namespace rpc
} // namespace torchrpc
