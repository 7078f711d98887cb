// The step function of program.json (Python: dsv4c/ir/serialize.py), as the executor walks it.
#ifndef DSV4C_SRC_PROGRAM_H_
#define DSV4C_SRC_PROGRAM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "json.h"

namespace dsv4c {

/// An IR type: a tensor (symbolic dimensions such as T are -1) or a KV-state token.
struct ValueType {
  bool state = false;
  std::string dtype;
  std::vector<int64_t> shape;
};

/// A node input: a weight (by name) or a value (by id, an index into the step's value table).
struct Operand {
  bool weight = false;
  std::string name;
  int64_t id = -1;
  ValueType type;
};

struct Node {
  std::string op;
  std::vector<Operand> inputs;
  json::Fields attrs;
  std::vector<int64_t> outputs;  // value ids
  std::vector<ValueType> output_types;
};

struct StepFunction {
  std::vector<int64_t> inputs;  // tokens, positions, seq_ids
  std::vector<Node> nodes;
  std::vector<int64_t> outputs;
  int64_t value_count = 0;
};

/// The "step" function of the program file; throws ArtifactError / IRError.
StepFunction read_step_function(const std::string& path);

}  // namespace dsv4c

#endif  // DSV4C_SRC_PROGRAM_H_
