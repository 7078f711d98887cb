// dsv4c_pool_trace GEOMETRY_JSON TOTAL_ROWS < ops
//
// Drives the C++ KVPool through an operation trace for the conformance test
// (tests/test_cpp_host.py), which runs the same trace through the Python KVPool. GEOMETRY_JSON
// holds the "model" and "pool_geometry" members of a manifest. Each input line is one of
//   admit SEQ RESERVE_TOKENS | ensure SEQ TOKENS | free SEQ
// and produces one JSON line: the error it raised (class and message, or null), then the whole
// allocator state: requests (seq, slot, block table), high-water marks, free lists, free envelopes.
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include "dsv4c/errors.h"
#include "dsv4c/kv_pool.h"
#include "json.h"
#include "model_config.h"

namespace {

std::string list(const std::vector<int64_t>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) out += (i ? ", " : "") + std::to_string(values[i]);
  return out + "]";
}

std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string state(const dsv4c::KVPool& pool, const std::string& error) {
  std::string requests;
  for (const auto& [seq, rows] : pool.requests()) {
    requests += std::string(requests.empty() ? "" : ", ") + "[" + std::to_string(seq) + ", " +
                std::to_string(rows.slot) + ", " + list(rows.blocks) + "]";
  }
  return "{\"error\": " + (error.empty() ? std::string("null") : error) + ", \"requests\": [" + requests +
         "], \"env_high\": " + std::to_string(pool.env_high()) +
         ", \"slot_high\": " + std::to_string(pool.slot_high()) +
         ", \"env_free\": " + list(pool.env_free()) + ", \"slot_free\": " + list(pool.slot_free()) +
         ", \"free_envelopes\": " + std::to_string(pool.free_envelopes()) + "}";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: dsv4c_pool_trace GEOMETRY_JSON TOTAL_ROWS < ops\n";
    return 2;
  }
  try {
    std::ifstream in(argv[1]);
    std::stringstream text;
    text << in.rdbuf();
    std::string problem;
    auto doc = dsv4c::json::parse(text.str(), &problem);
    auto object = doc ? dsv4c::json::as_object(*doc) : std::nullopt;
    if (!object) throw dsv4c::ArtifactError(std::string(argv[1]) + ": not a JSON object " + problem);
    dsv4c::json::Fields fields(*object, argv[1]);
    dsv4c::KVPool pool(dsv4c::pool_geometry(fields, dsv4c::model_config(fields)), std::stoll(argv[2]));
    std::string line;
    while (std::getline(std::cin, line)) {
      std::istringstream words(line);
      std::string op;
      int64_t seq = 0, count = 0;
      words >> op >> seq >> count;
      std::string error;
      try {
        if (op == "admit") {
          pool.admit(seq, count);
        } else if (op == "ensure") {
          pool.ensure(seq, count);
        } else if (op == "free") {
          pool.free(seq);
        } else {
          throw std::invalid_argument("unknown op " + op);
        }
      } catch (const dsv4c::PoolExhausted& e) {
        error = "[\"PoolExhausted\", " + quoted(e.what()) + "]";
      } catch (const dsv4c::UsageError& e) {
        error = "[\"UsageError\", " + quoted(e.what()) + "]";
      }
      std::cout << state(pool, error) << std::endl;
    }
  } catch (const std::exception& e) {
    std::cerr << "dsv4c_pool_trace: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
