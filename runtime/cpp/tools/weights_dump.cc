// dsv4c_weights_dump ART [--read]
//
// Loads an artifact's weights with read_artifact_weights (mapped; with --read, read) for the
// conformance test (tests/test_cpp_host.py), which compares them with Python's open_weights. One line per
// tensor, by name: name, DLPack dtype code and bits, shape (comma-separated), a checksum of its
// bytes (sum of byte * (i % 65521 + 1) over its bytes i, mod 2**64) and whether its data is
// 64-byte aligned. Errors print `dsv4c: error: <message>` and exit 2, as dsv4c_host does.
#include <cstdint>
#include <iostream>
#include <string>

#include "dsv4c/errors.h"
#include "safetensors.h"

int main(int argc, char** argv) {
  const bool read = argc == 3 && std::string(argv[2]) == "--read";
  if (argc != 2 && !read) {
    std::cerr << "usage: dsv4c_weights_dump ART [--read]\n";
    return 2;
  }
  try {
    for (const auto& [name, tensor] : dsv4c::read_artifact_weights(argv[1], read)) {
      const auto* bytes = static_cast<const unsigned char*>(tensor.data.get());
      uint64_t checksum = 0;
      for (size_t i = 0; i < tensor.nbytes(); ++i) checksum += bytes[i] * (i % 65521 + 1);
      std::string shape;
      for (int64_t d : tensor.shape) shape += (shape.empty() ? "" : ",") + std::to_string(d);
      std::cout << name << " " << int(tensor.dtype.code) << " " << int(tensor.dtype.bits) << " " << shape << " "
                << checksum << " " << tensor.aligned() << "\n";
    }
  } catch (const dsv4c::Error& e) {
    std::cerr << "dsv4c: error: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
