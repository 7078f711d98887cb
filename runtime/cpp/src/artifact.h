// Reading an artifact directory: paths as Python prints them, manifest.json and its checks
// (Python: dsv4c/artifact/manifest.py, same messages).
#ifndef DSV4C_SRC_ARTIFACT_H_
#define DSV4C_SRC_ARTIFACT_H_

#include <string>

#include "json.h"

namespace dsv4c {

inline constexpr int64_t kFormatVersion = 5;

/// `path` as str(pathlib.Path(path)) spells it: "." parts, repeated and trailing slashes dropped.
std::string python_path(const std::string& path);
/// str(Path(dir) / name).
std::string join_path(const std::string& dir, const std::string& name);

/// The manifest of artifact `directory`, checked: a directory, a readable manifest, its format
/// version, every listed file present with the size the manifest records, and the sha256 of every
/// file but the weight shards and Engram tables (small; the large ones are not read). `verify`
/// hashes every file instead (verify_artifact). Throws ArtifactError.
json::Fields read_manifest(const std::string& directory, bool verify = false);

}  // namespace dsv4c

#endif  // DSV4C_SRC_ARTIFACT_H_
