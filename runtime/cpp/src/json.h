// Typed access to JSON documents (manifest.json, program.json, safetensors headers).
//
// Parsing is tvm-ffi's json::Parse (shipped in libtvm_ffi.so, which the runtime links anyway):
// it keeps object members in file order, tells ints from floats like Python's json module and
// words its errors like it. This file adds typed, error-checked member access on top.
#ifndef DSV4C_SRC_JSON_H_
#define DSV4C_SRC_JSON_H_

#include <tvm/ffi/extra/json.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace dsv4c::json {

using Value = tvm::ffi::Any;
using Object = tvm::ffi::json::Object;
using Array = tvm::ffi::json::Array;

/// The parsed document, or nullopt with `error` set to a Python-json-like description.
std::optional<Value> parse(const std::string& text, std::string* error);

std::optional<Object> as_object(const Value& v);
std::optional<Array> as_array(const Value& v);
std::optional<std::string> as_string(const Value& v);
std::optional<int64_t> as_int(const Value& v);   // integers only (not floats, not bools)
std::optional<double> as_number(const Value& v);  // ints and floats
std::optional<std::vector<int64_t>> as_ints(const Value& v);

/// How Python's repr() prints the value json.loads would return (for messages).
std::string py_repr(const Value& v);
/// How Python's repr() prints a list of ints, or of strings.
std::string py_list(const std::vector<int64_t>& values);
std::string py_list(const std::vector<std::string>& values);

/// An object whose members are read with a type; a missing or mistyped member throws
/// ArtifactError "<file>: '<path.to.key>' is missing or not <type>; recompile".
class Fields {
 public:
  Fields(Object object, std::string file, std::string prefix = "");

  std::optional<Value> get(const std::string& key) const;
  Fields object(const std::string& key) const;
  Array array(const std::string& key) const;
  std::string string(const std::string& key) const;
  int64_t integer(const std::string& key) const;
  double number(const std::string& key) const;
  bool flag(const std::string& key) const;
  std::vector<int64_t> integers(const std::string& key) const;
  const std::string& file() const { return file_; }

  [[noreturn]] void fail(const std::string& key, const std::string& expected) const;

 private:
  Object object_;
  std::string file_;
  std::string prefix_;
};

}  // namespace dsv4c::json

#endif  // DSV4C_SRC_JSON_H_
