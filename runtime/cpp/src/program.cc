#include "program.h"

#include <fstream>
#include <map>
#include <sstream>

#include "dsv4c/errors.h"

namespace dsv4c {
namespace {

// The "type" member of a value: "state" or {"dtype", "shape"}.
ValueType read_type(const json::Fields& value) {
  std::optional<json::Value> v = value.get("type");
  if (v && json::as_string(*v) == "state") return ValueType{true, "", {}};
  std::optional<json::Object> object = v ? json::as_object(*v) : std::nullopt;
  if (!object) value.fail("type", "\"state\" or an object");
  json::Fields t(*object, value.file());
  ValueType type{false, t.string("dtype"), {}};
  for (const json::Value& dim : t.array("shape")) {
    std::optional<int64_t> size = json::as_int(dim);
    type.shape.push_back(size ? *size : -1);  // a symbolic dimension ("T", "E")
  }
  return type;
}

json::Fields entry(const json::Value& v, const std::string& file, const std::string& what) {
  std::optional<json::Object> object = json::as_object(v);
  if (!object) throw ArtifactError(file + ": " + what + " is not an object; recompile");
  return json::Fields(*object, file, what + ".");
}

}  // namespace

StepFunction read_step_function(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  std::string problem;
  std::optional<json::Value> doc = in ? json::parse(text.str(), &problem) : std::nullopt;
  std::optional<json::Object> program = doc ? json::as_object(*doc) : std::nullopt;
  if (!program) throw ArtifactError(path + ": unreadable program; recompile");
  std::optional<json::Fields> step;
  for (const json::Value& f : json::Fields(*program, path).array("functions")) {
    json::Fields fn = entry(f, path, "functions[]");
    if (fn.string("name") == "step") step = fn;
  }
  if (!step) throw ArtifactError(path + ": the program has no step function; recompile");

  StepFunction out;
  std::map<std::string, int64_t> ids;  // "%name" -> value id
  std::vector<ValueType> types;        // by value id
  std::map<std::string, ValueType> weights;  // "@name" -> type
  auto define = [&](const json::Fields& v) {
    ids["%" + v.string("name")] = out.value_count;
    types.push_back(read_type(v));
    return out.value_count++;
  };
  for (const json::Value& v : step->array("inputs")) out.inputs.push_back(define(entry(v, path, "inputs[]")));
  if (out.inputs.size() != 3) {
    throw ArtifactError(path + ": the step function must take tokens, positions and seq_ids; recompile");
  }
  for (const json::Value& v : step->array("weights")) {
    json::Fields w = entry(v, path, "weights[]");
    weights["@" + w.string("name")] = read_type(w);
  }
  for (const json::Value& n : step->array("nodes")) {
    json::Fields fields = entry(n, path, "nodes[]");
    Node node{fields.string("op"), {}, fields.object("attrs"), {}, {}};
    for (const json::Value& r : fields.array("inputs")) {
      std::string ref = json::as_string(r).value_or("");
      if (auto w = weights.find(ref); w != weights.end()) {
        node.inputs.push_back(Operand{true, ref.substr(1), -1, w->second});
      } else if (auto id = ids.find(ref); id != ids.end()) {
        node.inputs.push_back(Operand{false, ref.substr(1), id->second, types[id->second]});
      } else {
        throw IRError("@step: node " + node.op + " uses undefined value " + ref);
      }
    }
    for (const json::Value& o : fields.array("outputs")) {
      json::Fields output = entry(o, path, "nodes[].outputs[]");
      int64_t id = define(output);
      node.outputs.push_back(id);
      node.output_types.push_back(types[id]);
    }
    out.nodes.push_back(std::move(node));
  }
  for (const json::Value& r : step->array("outputs")) {
    auto id = ids.find(json::as_string(r).value_or(""));
    if (id == ids.end()) throw IRError("@step: output " + json::py_repr(r) + " is undefined");
    out.outputs.push_back(id->second);
  }
  return out;
}

}  // namespace dsv4c
