#pragma once

// Conversions between C++ values and c10::IValue, with the type checks that
// make a mismatched call a clear error instead of a crash. Used by the
// function registry (arguments, results of registered functions) and by the
// typed call API (arguments, results at the caller).

#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <c10/util/Optional.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace torchrpc {
namespace rpc {

template <typename T>
class Future;

namespace detail {

// Note [Values in containers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ValueTraits<T> says how a C++ type travels as an IValue: type() (its
// static c10 type, for checks and messages), accepts(value), from(value)
// (called only after accepts) and, where libtorch cannot convert T itself,
// toIValue(const T&); optionally explain(value), why accepts refused a value
// where its type name does not say. Two flags describe a ValueTraits; an
// upper layer's (RRef<T>) declares neither:
//  - kCheckedByType: a value fits iff its c10 type is a subtype of type().
//    Inside containers that is the whole check, as libtorch makes it; only a
//    whole argument or result promotes an int to a float.
//  - kLibtorchConverts: IValue::to<T>() and IValue(T) convert it.
// std::vector, c10::optional, std::tuple and std::unordered_map compose the
// traits of their elements:
//  1. A container of kCheckedByType elements is checked by its c10 type
//     alone, one check whatever its size; one of kLibtorchConverts elements
//     converts through libtorch. Both as before containers composed.
//  2. Otherwise each element goes through its own traits. A list or dict is
//     accepted if its static element type is a subtype of the elements'
//     type() (or Any) and every element is accepted: an IValue of type
//     RRef[T] may hold an RRef that torchrpc did not create, or none.
//  3. toIValue() gives a generic list or dict the elements' type() as its
//     static type, so the receiver's check passes, empty or not; Any if an
//     element does not fit it (RRef types are invariant, and an
//     RRef<c10::IValue> holds any).
//  4. explain() names the element refused: "List[Any] (element 2 has type
//     int)".
// c10::List<T> and c10::Dict<K, V> hold only what libtorch converts: RRefs
// in them travel as c10::IValue.

template <typename T, typename Enable = void>
struct ValueTraits {
  static constexpr bool kCheckedByType = true;
  static constexpr bool kLibtorchConverts = true;
  static c10::TypePtr type() {
    return c10::getTypePtrCopy<T>();
  }
  static bool accepts(const c10::IValue& value) {
    // IValue::type() allocates (a TensorType per tensor, once per argument
    // of every call): the common kinds are checked on the tag alone.
    if constexpr (std::is_same<T, at::Tensor>::value) {
      return value.isTensor();
    } else if constexpr (std::is_same<T, bool>::value) {
      return value.isBool();
    } else if constexpr (std::is_same<T, std::string>::value) {
      return value.isString();
    } else {
      return value.type()->isSubtypeOf(*type());
    }
  }
  static T from(c10::IValue&& value) {
    return std::move(value).to<T>();
  }
};

template <>
struct ValueTraits<c10::IValue> {
  static constexpr bool kCheckedByType = true;
  static constexpr bool kLibtorchConverts = false;
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
  static constexpr bool kCheckedByType = true;
  static constexpr bool kLibtorchConverts = false;
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
  static constexpr bool kCheckedByType = true;
  static constexpr bool kLibtorchConverts = std::is_same<T, double>::value;
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

// The flags of Note [Values in containers]; false where a ValueTraits does
// not declare them.
template <typename T, typename = void>
struct CheckedByType : std::false_type {};
template <typename T>
struct CheckedByType<T, std::enable_if_t<ValueTraits<T>::kCheckedByType>>
    : std::true_type {};
template <typename T, typename = void>
struct LibtorchConverts : std::false_type {};
template <typename T>
struct LibtorchConverts<T, std::enable_if_t<ValueTraits<T>::kLibtorchConverts>>
    : std::true_type {};

template <typename... T>
constexpr bool kAllCheckedByType = (CheckedByType<T>::value && ...);
template <typename... T>
constexpr bool kAllLibtorchConverts = (LibtorchConverts<T>::value && ...);

// An upper layer's value type (an RRef) converts itself by giving its
// ValueTraits a static toIValue(const T&); so do containers of such types.
template <typename T, typename = void>
struct HasToIValue : std::false_type {};
template <typename T>
struct HasToIValue<
    T,
    std::void_t<decltype(ValueTraits<T>::toIValue(std::declval<const T&>()))>>
    : std::true_type {};

// Converts an argument or a result to an IValue.
template <typename T>
c10::IValue toIValue(T&& value);

// An RRef IValue holding nullptr (what an empty RRef<T>'s toIValue() gives),
// whose IValue::type() dereferences it.
inline bool isEmptyRRef(const c10::IValue& value) {
  return value.isRRef() && !value.toRRef();
}

// The name of a value's type, for error messages.
inline std::string typeName(const c10::IValue& value) {
  if (isEmptyRRef(value)) {
    return "RRef (empty)";
  }
  return value.type()->annotation_str();
}

template <typename T>
std::string typeName() {
  return ValueTraits<std::decay_t<T>>::type()->annotation_str();
}

template <typename T, typename = void>
struct HasExplain : std::false_type {};
template <typename T>
struct HasExplain<
    T,
    std::void_t<decltype(ValueTraits<T>::explain(
        std::declval<const c10::IValue&>()))>> : std::true_type {};

// Why ValueTraits<T> refuses `value`, where its type name alone does not
// say (an element deep inside, an RRef torchrpc did not create); empty
// otherwise.
template <typename T>
std::string explainMismatch(const c10::IValue& value) {
  if constexpr (HasExplain<T>::value) {
    return ValueTraits<T>::explain(value);
  } else {
    return "";
  }
}

// The value's type name, with the explanation above if there is one.
template <typename T>
std::string describeValue(const c10::IValue& value) {
  std::string out = typeName(value);
  std::string why = explainMismatch<std::decay_t<T>>(value);
  if (!why.empty()) {
    out += " (" + why + ")";
  }
  return out;
}

// Whether an element of a container fits E; see Note [Values in containers].
template <typename E>
bool acceptsElement(const c10::IValue& value) {
  if constexpr (CheckedByType<E>::value) {
    return isEmptyRRef(value)
        ? ValueTraits<E>::type()->kind() == c10::TypeKind::AnyType
        : value.type()->isSubtypeOf(*ValueTraits<E>::type());
  } else {
    return ValueTraits<E>::accepts(value);
  }
}

template <typename E>
std::string explainElement(const std::string& which, const c10::IValue& value) {
  return which + " has type " + describeValue<E>(value);
}

// Whether a generic list or dict declared to hold `declared` may hold
// elements of E that are checked one by one.
template <typename E>
bool declaredFits(const c10::Type& declared) {
  return declared.kind() == c10::TypeKind::AnyType ||
      declared.isSubtypeOf(*ValueTraits<E>::type());
}

// The static type of a generic list or dict holding `elements` as E: E's
// type(), or Any if an element does not fit it (an RRef<c10::IValue> holds
// RRefs of any type, and RRef types are invariant).
template <typename E, typename Elements, typename Get>
c10::TypePtr storedType(const Elements& elements, Get&& get) {
  c10::TypePtr type = ValueTraits<E>::type();
  if constexpr (!CheckedByType<E>::value) {
    for (const auto& element : elements) {
      const c10::IValue& value = get(element);
      if (isEmptyRRef(value) || !value.type()->isSubtypeOf(*type)) {
        return c10::AnyType::get();
      }
    }
  }
  return type;
}

template <typename E>
struct ValueTraits<std::vector<E>> {
  static constexpr bool kCheckedByType = CheckedByType<E>::value;
  static constexpr bool kLibtorchConverts = LibtorchConverts<E>::value;

  static c10::TypePtr type() {
    static const c10::TypePtr type =
        c10::ListType::create(ValueTraits<E>::type());
    return type;
  }

  static bool accepts(const c10::IValue& value) {
    if constexpr (kCheckedByType) {
      return value.type()->isSubtypeOf(*type());
    } else {
      if (!value.isList() || !declaredFits<E>(*value.toList().elementType())) {
        return false;
      }
      for (const c10::IValue& element : value.toListRef()) {
        if (!ValueTraits<E>::accepts(element)) {
          return false;
        }
      }
      return true;
    }
  }

  static std::string explain(const c10::IValue& value) {
    if (!value.isList() || !declaredFits<E>(*value.toList().elementType())) {
      return "";
    }
    const auto elements = value.toListRef();
    for (size_t i = 0; i < elements.size(); ++i) {
      if (!acceptsElement<E>(elements[i])) {
        return explainElement<E>("element " + std::to_string(i), elements[i]);
      }
    }
    return "";
  }

  static std::vector<E> from(c10::IValue&& value) {
    if constexpr (kLibtorchConverts) {
      return std::move(value).to<std::vector<E>>();
    } else {
      std::vector<E> out;
      const auto elements = value.toListRef();
      out.reserve(elements.size());
      for (const c10::IValue& element : elements) {
        out.push_back(ValueTraits<E>::from(c10::IValue(element)));
      }
      return out;
    }
  }

  template <
      typename V = std::vector<E>,
      std::enable_if_t<!ValueTraits<V>::kLibtorchConverts, int> = 0>
  static c10::IValue toIValue(const std::vector<E>& value) {
    std::vector<c10::IValue> elements;
    elements.reserve(value.size());
    for (const auto& element : value) {
      elements.push_back(detail::toIValue(element));
    }
    c10::impl::GenericList list(storedType<E>(
        elements,
        [](const c10::IValue& element) -> const c10::IValue& {
          return element;
        }));
    list.reserve(elements.size());
    for (auto& element : elements) {
      list.push_back(std::move(element));
    }
    return c10::IValue(std::move(list));
  }
};

template <typename E>
struct ValueTraits<c10::optional<E>> {
  static constexpr bool kCheckedByType = CheckedByType<E>::value;
  static constexpr bool kLibtorchConverts = LibtorchConverts<E>::value;

  static c10::TypePtr type() {
    static const c10::TypePtr type =
        c10::OptionalType::create(ValueTraits<E>::type());
    return type;
  }

  static bool accepts(const c10::IValue& value) {
    if constexpr (kCheckedByType) {
      return value.type()->isSubtypeOf(*type());
    } else {
      return value.isNone() || ValueTraits<E>::accepts(value);
    }
  }

  static std::string explain(const c10::IValue& value) {
    return value.isNone() ? "" : explainMismatch<E>(value);
  }

  static c10::optional<E> from(c10::IValue&& value) {
    if constexpr (kLibtorchConverts) {
      return std::move(value).to<c10::optional<E>>();
    } else {
      if (value.isNone()) {
        return c10::nullopt;
      }
      return ValueTraits<E>::from(std::move(value));
    }
  }

  template <
      typename V = c10::optional<E>,
      std::enable_if_t<!ValueTraits<V>::kLibtorchConverts, int> = 0>
  static c10::IValue toIValue(const c10::optional<E>& value) {
    return value.has_value() ? detail::toIValue(*value) : c10::IValue();
  }
};

template <typename... E>
struct ValueTraits<std::tuple<E...>> {
  static constexpr bool kCheckedByType = kAllCheckedByType<E...>;
  static constexpr bool kLibtorchConverts = kAllLibtorchConverts<E...>;
  using Indices = std::index_sequence_for<E...>;

  static c10::TypePtr type() {
    static const c10::TypePtr type =
        c10::TupleType::create({ValueTraits<E>::type()...});
    return type;
  }

  // Element by element, the check TupleType::isSubtypeOf makes (tuples are
  // covariant), without building the value's TupleType.
  static bool accepts(const c10::IValue& value) {
    return value.isTuple() &&
        value.toTupleRef().elements().size() == sizeof...(E) &&
        acceptsAll(value.toTupleRef().elements(), Indices{});
  }

  static std::string explain(const c10::IValue& value) {
    if (!value.isTuple() ||
        value.toTupleRef().elements().size() != sizeof...(E)) {
      return "";
    }
    return explainFirst(value.toTupleRef().elements(), Indices{});
  }

  static std::tuple<E...> from(c10::IValue&& value) {
    if constexpr (kLibtorchConverts) {
      return std::move(value).to<std::tuple<E...>>();
    } else {
      return fromElements(value.toTupleRef().elements(), Indices{});
    }
  }

  template <
      typename V = std::tuple<E...>,
      std::enable_if_t<!ValueTraits<V>::kLibtorchConverts, int> = 0>
  static c10::IValue toIValue(const std::tuple<E...>& value) {
    return toIValueElements(value, Indices{});
  }

 private:
  template <size_t... I>
  static bool acceptsAll(
      c10::ArrayRef<c10::IValue> elements,
      std::index_sequence<I...>) {
    (void)elements; // unused for std::tuple<>
    return (acceptsElement<E>(elements[I]) && ...);
  }

  template <size_t... I>
  static std::string explainFirst(
      c10::ArrayRef<c10::IValue> elements,
      std::index_sequence<I...>) {
    (void)elements;
    std::string out;
    (void)(explainAt<I>(elements[I], &out) && ...); // to the first refused
    return out;
  }

  // False if element I is refused; then *out says why, if the tuple's type
  // name, which shows each element's type, does not.
  template <size_t I>
  static bool explainAt(const c10::IValue& element, std::string* out) {
    using Element = std::tuple_element_t<I, std::tuple<E...>>;
    if (acceptsElement<Element>(element)) {
      return true;
    }
    if (!explainMismatch<Element>(element).empty()) {
      *out = explainElement<Element>("element " + std::to_string(I), element);
    }
    return false;
  }

  template <size_t... I>
  static std::tuple<E...> fromElements(
      c10::ArrayRef<c10::IValue> elements,
      std::index_sequence<I...>) {
    (void)elements;
    return std::tuple<E...>(ValueTraits<E>::from(c10::IValue(elements[I]))...);
  }

  template <size_t... I>
  static c10::IValue toIValueElements(
      const std::tuple<E...>& value,
      std::index_sequence<I...>) {
    (void)value;
    return c10::IValue(c10::ivalue::Tuple::create(
        std::vector<c10::IValue>{detail::toIValue(std::get<I>(value))...}));
  }
};

template <typename K, typename V>
struct ValueTraits<std::unordered_map<K, V>> {
  static constexpr bool kCheckedByType = kAllCheckedByType<K, V>;
  static constexpr bool kLibtorchConverts = kAllLibtorchConverts<K, V>;

  static c10::TypePtr type() {
    static const c10::TypePtr type =
        c10::DictType::create(ValueTraits<K>::type(), ValueTraits<V>::type());
    return type;
  }

  static bool accepts(const c10::IValue& value) {
    if constexpr (kCheckedByType) {
      return value.type()->isSubtypeOf(*type());
    } else {
      if (!declaredFits(value)) {
        return false;
      }
      for (const auto& entry : value.toGenericDict()) {
        if (!acceptsElement<K>(entry.key()) ||
            !acceptsElement<V>(entry.value())) {
          return false;
        }
      }
      return true;
    }
  }

  static std::string explain(const c10::IValue& value) {
    if (!declaredFits(value)) {
      return "";
    }
    for (const auto& entry : value.toGenericDict()) {
      if (!acceptsElement<K>(entry.key())) {
        return explainElement<K>("a key", entry.key());
      }
      if (!acceptsElement<V>(entry.value())) {
        return explainElement<V>(
            "the value of key " + describeKey(entry.key()),
            entry.value());
      }
    }
    return "";
  }

  static std::unordered_map<K, V> from(c10::IValue&& value) {
    if constexpr (kLibtorchConverts) {
      return std::move(value).to<std::unordered_map<K, V>>();
    } else {
      std::unordered_map<K, V> out;
      auto dict = value.toGenericDict();
      out.reserve(dict.size());
      for (const auto& entry : dict) {
        out.emplace(
            ValueTraits<K>::from(c10::IValue(entry.key())),
            ValueTraits<V>::from(c10::IValue(entry.value())));
      }
      return out;
    }
  }

  // Also for what libtorch converts: its IValue(std::unordered_map) is
  // deprecated ("slow") and builds the same dict.
  static c10::IValue toIValue(const std::unordered_map<K, V>& value) {
    std::vector<std::pair<c10::IValue, c10::IValue>> entries;
    entries.reserve(value.size());
    for (const auto& entry : value) {
      entries.emplace_back(
          detail::toIValue(entry.first),
          detail::toIValue(entry.second));
    }
    c10::impl::GenericDict dict(
        ValueTraits<K>::type(),
        storedType<V>(
            entries,
            [](const std::pair<c10::IValue, c10::IValue>& entry)
                -> const c10::IValue& { return entry.second; }));
    dict.reserve(entries.size());
    for (auto& entry : entries) {
      dict.insert_or_assign(std::move(entry.first), std::move(entry.second));
    }
    return c10::IValue(std::move(dict));
  }

 private:
  // Whether value is a dict whose static key and value types admit K and V
  // (see Note [Values in containers]).
  static bool declaredFits(const c10::IValue& value) {
    if (!value.isGenericDict()) {
      return false;
    }
    auto dict = value.toGenericDict();
    return detail::declaredFits<K>(*dict.keyType()) &&
        detail::declaredFits<V>(*dict.valueType());
  }

  static std::string describeKey(const c10::IValue& key) {
    if (key.isString()) {
      return "'" + key.toStringRef() + "'";
    }
    if (key.isInt()) {
      return std::to_string(key.toInt());
    }
    return "of type " + typeName(key);
  }
};

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

} // namespace detail
} // namespace rpc
} // namespace torchrpc
