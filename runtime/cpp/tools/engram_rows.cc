// dsv4c_engram_rows HASH_FILE < requests
//
// Hashes token streams with the C++ EngramHash for the conformance test (tests/test_cpp_host.py),
// which hashes the same streams with Python's EngramTables.request_rows. Each input line is
//   START STOP TOKEN_ID...
// (positions START .. STOP - 1 of a request whose token ids by position are TOKEN_ID...) and
// produces one line: the rows [STOP - START, L_e, C] flattened, space-separated, or the error's
// message for a token id outside the vocabulary. A hash file that does not load prints
// `dsv4c: error: <message>` and exits 2, as dsv4c_host does.
#include <cstdint>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "dsv4c/errors.h"
#include "engram.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: dsv4c_engram_rows HASH_FILE < requests\n";
    return 2;
  }
  try {
    const dsv4c::EngramHash hash = dsv4c::EngramHash::load(argv[1]);
    for (std::string line; std::getline(std::cin, line);) {
      std::istringstream fields(line);
      int64_t start = 0, stop = 0;
      fields >> start >> stop;
      std::vector<int32_t> tokens;
      for (int32_t t; fields >> t;) tokens.push_back(t);
      std::vector<int32_t> rows;
      try {
        hash.request_rows(tokens, start, stop, rows);
      } catch (const dsv4c::UsageError& e) {
        std::cout << e.what() << "\n";
        continue;
      }
      for (size_t i = 0; i < rows.size(); ++i) std::cout << (i ? " " : "") << rows[i];
      std::cout << "\n";
    }
  } catch (const dsv4c::Error& e) {
    std::cerr << "dsv4c: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
