// SHA-256 (FIPS 180-4) of a file, to check artifact files against the manifest.
#ifndef DSV4C_SRC_SHA256_H_
#define DSV4C_SRC_SHA256_H_

#include <string>

namespace dsv4c {

/// Lower-case hex digest of the file's bytes (Python: hashlib.sha256(...).hexdigest()).
/// Throws std::runtime_error if the file cannot be read.
std::string sha256_of_file(const std::string& path);

}  // namespace dsv4c

#endif  // DSV4C_SRC_SHA256_H_
