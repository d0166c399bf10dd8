// config.json into typed structs, one declaration per field.
//
// A config struct lists its fields once, in a `fields(V&)` template; the same list drives
// reading (with defaults and validation), writing and printing:
//
//   struct Gpt2Config {
//     int64_t n_embd = 768;
//     double layer_norm_epsilon = 1e-5;
//     template <class V> void fields(V& v) {
//       v("n_embd", n_embd, Presence::Required).positive();
//       v("layer_norm_epsilon", layer_norm_epsilon).positive();
//     }
//   };
//   auto cfg = read_config<Gpt2Config>(json, "gpt2-tiny/config.json");
#pragma once

#include <cstdint>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"

namespace k3 {

using Json = nlohmann::json;

enum class Presence { Optional, Required };

Json read_json_file(const std::string& path);  // k3::Error naming the file on failure

namespace detail {
template <class T> struct is_optional : std::false_type {};
template <class T> struct is_optional<std::optional<T>> : std::true_type {};

bool json_to(const Json& j, int64_t& out);
bool json_to(const Json& j, double& out);
bool json_to(const Json& j, bool& out);
bool json_to(const Json& j, std::string& out);
bool json_to(const Json& j, std::vector<int64_t>& out);
template <class T>
bool json_to(const Json& j, std::optional<T>& out) {
  if (j.is_null()) { out.reset(); return true; }
  T v{};
  if (!json_to(j, v)) return false;
  out = v;
  return true;
}
template <class T> const char* type_name();
}  // namespace detail

// Validation chained after a field: v("x", x).positive(). Inactive when writing.
template <class T>
class FieldCheck {
 public:
  FieldCheck(const std::string* where, const char* name, const T* value) : where_(where), name_(name), value_(value) {}
  FieldCheck& positive() { return test([](double x) { return x > 0; }, "must be > 0"); }
  FieldCheck& non_negative() { return test([](double x) { return x >= 0; }, "must be >= 0"); }
  FieldCheck& at_most(double hi) { return test([hi](double x) { return x <= hi; }, "must be <= " + number(hi)); }
  FieldCheck& in_range(double lo, double hi) {
    return test([lo, hi](double x) { return x >= lo && x <= hi; }, "must be in [" + number(lo) + ", " + number(hi) + "]");
  }
  // A special token's id (bos, eos, pad): a negative one is refused; one at or past the vocabulary
  // is reported, not refused (transformers accepts it and some published test configs have it),
  // since no sampled token can ever equal it.
  FieldCheck& token_id(int64_t vocab) {
    test([](double x) { return x >= 0; }, "must be >= 0");
    if constexpr (detail::is_optional<T>::value) {
      if (where_ && *value_ && **value_ >= vocab)
        std::cerr << "k3: warning: " << *where_ << ": " << name_ << " " << **value_
                  << " is not a token id of the vocabulary (vocab_size " << vocab << "); nothing will match it\n";
    }
    return *this;
  }
  FieldCheck& one_of(std::initializer_list<const char*> options) {
    if constexpr (std::is_same_v<T, std::string>) {
      if (!where_) return *this;
      for (const char* o : options)
        if (*value_ == o) return *this;
      std::string list;
      for (const char* o : options) list += std::string(list.empty() ? "" : ", ") + o;
      throw error("config", *where_, ": field '", name_, "' = \"", *value_, "\" is not supported (expected one of: ", list, ")");
    }
    return *this;
  }

 private:
  template <class P>
  FieldCheck& test(P pred, const std::string& rule) {
    if (!where_) return *this;
    if constexpr (std::is_arithmetic_v<T>) {
      if (!pred(double(*value_))) throw error("config", *where_, ": field '", name_, "' = ", *value_, " ", rule);
    } else if constexpr (detail::is_optional<T>::value) {
      if (*value_ && !pred(double(**value_))) throw error("config", *where_, ": field '", name_, "' = ", **value_, " ", rule);
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      for (int64_t x : *value_)
        if (!pred(double(x))) throw error("config", *where_, ": field '", name_, "' has entry ", x, " that ", rule);
    }
    return *this;
  }
  static std::string number(double x) {
    std::ostringstream os;
    os.precision(15);
    os << x;
    return os.str();
  }
  const std::string* where_;  // null: writing, no checks
  const char* name_;
  const T* value_;
};

// Reads fields from a JSON object; `where` names the source in messages.
class ConfigReader {
 public:
  ConfigReader(const Json& j, std::string where) : j_(j), where_(std::move(where)) {}
  template <class T>
  FieldCheck<T> operator()(const char* name, T& value, Presence presence = Presence::Optional) {
    auto it = j_.find(name);
    if (it == j_.end() || (it->is_null() && !detail::is_optional<T>::value)) {
      if (presence == Presence::Required) throw error("config", where_, ": missing required field '", name, "'");
    } else if (!detail::json_to(*it, value)) {
      throw error("config", where_, ": field '", name, "' should be ", detail::type_name<T>(), ", got ", it->dump());
    }
    return FieldCheck<T>(&where_, name, &value);
  }
  const Json& json() const { return j_; }
  const std::string& where() const { return where_; }

 private:
  const Json& j_;
  std::string where_;
};

// Writes fields into a JSON object.
class ConfigWriter {
 public:
  explicit ConfigWriter(Json& j) : j_(j) {}
  template <class T>
  FieldCheck<T> operator()(const char* name, T& value, Presence = Presence::Optional) {
    if constexpr (detail::is_optional<T>::value) {
      if (value) j_[name] = *value; else j_[name] = nullptr;
    } else {
      j_[name] = value;
    }
    return FieldCheck<T>(nullptr, name, &value);
  }

 private:
  Json& j_;
};

template <class C>
C read_config(const Json& j, const std::string& where) {
  if (!j.is_object()) throw error("config", where, ": expected a JSON object");
  C c;
  ConfigReader r(j, where);
  c.fields(r);
  return c;
}

template <class C>
Json write_config(const C& c) {
  Json j = Json::object();
  ConfigWriter w(j);
  const_cast<C&>(c).fields(w);
  return j;
}

}  // namespace k3
