#include "json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "dsv4c/errors.h"

namespace dsv4c::json {
namespace ffi = tvm::ffi;

std::optional<Value> parse(const std::string& text, std::string* error) {
  ffi::String message;
  Value v = ffi::json::Parse(ffi::String(text), &message);
  if (!message.empty()) {
    *error = std::string(message);
    return std::nullopt;
  }
  return v;
}

std::optional<Object> as_object(const Value& v) {
  if (v.type_index() != ffi::TypeIndex::kTVMFFIMap) return std::nullopt;
  return v.cast<Object>();
}

std::optional<Array> as_array(const Value& v) {
  if (v.type_index() != ffi::TypeIndex::kTVMFFIArray) return std::nullopt;
  return v.cast<Array>();
}

std::optional<std::string> as_string(const Value& v) {
  if (auto s = v.as<ffi::String>()) return std::string(*s);
  return std::nullopt;
}

std::optional<int64_t> as_int(const Value& v) {
  if (v.type_index() != ffi::TypeIndex::kTVMFFIInt) return std::nullopt;
  return v.cast<int64_t>();
}

std::optional<double> as_number(const Value& v) {
  if (v.type_index() == ffi::TypeIndex::kTVMFFIFloat) return v.cast<double>();
  if (auto i = as_int(v)) return static_cast<double>(*i);
  return std::nullopt;
}

std::optional<std::vector<int64_t>> as_ints(const Value& v) {
  auto array = as_array(v);
  if (!array) return std::nullopt;
  std::vector<int64_t> out;
  for (const Value& item : *array) {
    auto i = as_int(item);
    if (!i) return std::nullopt;
    out.push_back(*i);
  }
  return out;
}

namespace {

// Python's float repr: the shortest digits that read back exactly, in exponent form when the
// decimal exponent is below -4 or at least 16.
std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*e", precision - 1, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::string s(buf);  // [-]d[.ddd]e[+-]XX
  size_t e = s.find('e');
  int exponent = std::atoi(s.c_str() + e + 1);
  bool negative = s[0] == '-';
  std::string digits;
  for (size_t i = negative; i < e; ++i) {
    if (s[i] != '.') digits += s[i];
  }
  std::string out = negative ? "-" : "";
  if (exponent < -4 || exponent >= 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char exp[16];
    std::snprintf(exp, sizeof exp, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out + exp;
  }
  if (exponent < 0) return out + "0." + std::string(-exponent - 1, '0') + digits;
  if (digits.size() <= static_cast<size_t>(exponent) + 1) {
    return out + digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
  }
  return out + digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
}

// Python's str repr: single quotes unless the text holds ' and no ".
std::string string_repr(const std::string& s) {
  char quote = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, quote);
  for (unsigned char c : s) {
    if (c == '\\' || c == quote) {
      out += '\\', out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + quote;
}

}  // namespace

std::string py_repr(const Value& v) {
  switch (v.type_index()) {
    case ffi::TypeIndex::kTVMFFINone:
      return "None";
    case ffi::TypeIndex::kTVMFFIBool:
      return v.cast<bool>() ? "True" : "False";
    case ffi::TypeIndex::kTVMFFIInt:
      return std::to_string(v.cast<int64_t>());
    case ffi::TypeIndex::kTVMFFIFloat:
      return float_repr(v.cast<double>());
    default:
      break;
  }
  if (auto s = as_string(v)) return string_repr(*s);
  if (auto array = as_array(v)) {
    std::string out = "[";
    for (const Value& item : *array) out += (out.size() > 1 ? ", " : "") + py_repr(item);
    return out + "]";
  }
  if (auto object = as_object(v)) {
    std::string out = "{";
    for (const auto& [key, value] : *object) out += (out.size() > 1 ? ", " : "") + py_repr(key) + ": " + py_repr(value);
    return out + "}";
  }
  return v.GetTypeKey();
}

std::string py_list(const std::vector<int64_t>& values) {
  std::string out;
  for (int64_t v : values) out += (out.empty() ? "" : ", ") + std::to_string(v);
  return "[" + out + "]";
}

std::string py_list(const std::vector<std::string>& values) {
  std::string out;
  for (const std::string& v : values) out += (out.empty() ? "" : ", ") + string_repr(v);
  return "[" + out + "]";
}

Fields::Fields(Object object, std::string file, std::string prefix)
    : object_(std::move(object)), file_(std::move(file)), prefix_(std::move(prefix)) {}

std::optional<Value> Fields::get(const std::string& key) const { return object_.Get(ffi::String(key)); }

void Fields::fail(const std::string& key, const std::string& expected) const {
  throw ArtifactError(file_ + ": '" + prefix_ + key + "' is missing or not " + expected + "; recompile");
}

Fields Fields::object(const std::string& key) const {
  auto v = get(key);
  auto o = v ? as_object(*v) : std::nullopt;
  if (!o) fail(key, "an object");
  return Fields(*o, file_, prefix_ + key + ".");
}

Array Fields::array(const std::string& key) const {
  auto v = get(key);
  auto a = v ? as_array(*v) : std::nullopt;
  if (!a) fail(key, "a list");
  return *a;
}

std::string Fields::string(const std::string& key) const {
  auto v = get(key);
  auto s = v ? as_string(*v) : std::nullopt;
  if (!s) fail(key, "a string");
  return *s;
}

int64_t Fields::integer(const std::string& key) const {
  auto v = get(key);
  auto i = v ? as_int(*v) : std::nullopt;
  if (!i) fail(key, "an integer");
  return *i;
}

double Fields::number(const std::string& key) const {
  auto v = get(key);
  auto x = v ? as_number(*v) : std::nullopt;
  if (!x) fail(key, "a number");
  return *x;
}

bool Fields::flag(const std::string& key) const {
  auto v = get(key);
  if (!v || v->type_index() != ffi::TypeIndex::kTVMFFIBool) fail(key, "true or false");
  return v->cast<bool>();
}

std::vector<int64_t> Fields::integers(const std::string& key) const {
  auto v = get(key);
  auto ints = v ? as_ints(*v) : std::nullopt;
  if (!ints) fail(key, "a list of integers");
  return *ints;
}

}  // namespace dsv4c::json
