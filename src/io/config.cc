#include "io/config.h"

#include <fstream>

namespace k3 {

Json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw error("config", path, ": cannot open (missing file?)");
  try {
    return Json::parse(in);
  } catch (const Json::exception& e) {
    throw error("config", path, ": not valid JSON: ", e.what());
  }
}

namespace detail {
bool json_to(const Json& j, int64_t& out) {
  if (j.is_number_integer()) { out = j.get<int64_t>(); return true; }
  if (j.is_number_float()) {
    double d = j.get<double>();
    if (d != double(int64_t(d))) return false;
    out = int64_t(d);
    return true;
  }
  return false;
}
bool json_to(const Json& j, double& out) {
  if (!j.is_number()) return false;
  out = j.get<double>();
  return true;
}
bool json_to(const Json& j, bool& out) {
  if (!j.is_boolean()) return false;
  out = j.get<bool>();
  return true;
}
bool json_to(const Json& j, std::string& out) {
  if (!j.is_string()) return false;
  out = j.get<std::string>();
  return true;
}
bool json_to(const Json& j, std::vector<int64_t>& out) {
  if (!j.is_array()) return false;
  out.clear();
  for (const auto& x : j) {
    int64_t v;
    if (!json_to(x, v)) return false;
    out.push_back(v);
  }
  return true;
}
template <> const char* type_name<int64_t>() { return "an integer"; }
template <> const char* type_name<double>() { return "a number"; }
template <> const char* type_name<bool>() { return "true or false"; }
template <> const char* type_name<std::string>() { return "a string"; }
template <> const char* type_name<std::vector<int64_t>>() { return "a list of integers"; }
template <> const char* type_name<std::optional<int64_t>>() { return "an integer or null"; }
template <> const char* type_name<std::optional<double>>() { return "a number or null"; }
template <> const char* type_name<std::optional<std::string>>() { return "a string or null"; }
template <> const char* type_name<std::optional<bool>>() { return "true, false or null"; }
}  // namespace detail

}  // namespace k3
