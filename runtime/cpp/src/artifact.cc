#include "artifact.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <sstream>
#include <vector>

#include "dsv4c/errors.h"
#include "dsv4c/runtime.h"
#include "sha256.h"

namespace dsv4c {
namespace {

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// The OSError subclass Python raises for `err`, named as the manifest message names it.
std::string os_error_name(int err) {
  switch (err) {
    case ENOENT:
      return "FileNotFoundError";
    case EISDIR:
      return "IsADirectoryError";
    case ENOTDIR:
      return "NotADirectoryError";
    case EACCES:
    case EPERM:
      return "PermissionError";
    default:
      return "OSError";
  }
}

// The whole file, or the errno that stopped reading it.
int read_all(const std::string& path, std::string* out) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  char buf[1 << 16];
  ssize_t got;
  while ((got = ::read(fd, buf, sizeof buf)) > 0) out->append(buf, static_cast<size_t>(got));
  int err = got < 0 ? errno : 0;
  ::close(fd);
  return err;
}

}  // namespace

std::string python_path(const std::string& path) {
  // POSIX keeps a leading "//" (exactly two slashes) as its own root; pathlib does too.
  size_t slashes = std::min(path.find_first_not_of('/'), path.size());
  std::string root = slashes == 2 ? "//" : slashes ? "/" : "";
  std::string out = root, part;
  std::istringstream parts(path);
  while (std::getline(parts, part, '/')) {
    if (part.empty() || part == ".") continue;
    if (out.size() > root.size()) out += '/';
    out += part;
  }
  return out.empty() ? "." : out;
}

std::string join_path(const std::string& dir, const std::string& name) {
  if (name.rfind('/', 0) == 0) return python_path(name);  // an absolute name replaces the directory
  return python_path(dir + "/" + name);
}

namespace {

// The manifest's "files": {name: {"bytes": size, "sha256": hex digest}}, in file order.
struct ListedFile {
  std::string name;
  int64_t bytes;
  std::string sha256;
};

std::vector<ListedFile> listed_files(const json::Object& manifest, const std::string& path) {
  std::optional<json::Value> files = manifest.Get(tvm::ffi::String("files"));
  std::optional<json::Object> listed = files ? json::as_object(*files) : std::nullopt;
  if (!listed) throw ArtifactError(path + ": manifest has no file list; recompile");
  std::vector<ListedFile> out;
  for (const auto& [key, entry] : *listed) {
    std::optional<json::Object> fields = json::as_object(entry);
    std::optional<json::Value> bytes = fields ? fields->Get(tvm::ffi::String("bytes")) : std::nullopt;
    std::optional<json::Value> digest = fields ? fields->Get(tvm::ffi::String("sha256")) : std::nullopt;
    std::optional<int64_t> size = bytes ? json::as_int(*bytes) : std::nullopt;
    std::optional<std::string> hex = digest ? json::as_string(*digest) : std::nullopt;
    if (!size || !hex) throw ArtifactError(path + ": manifest has no file list; recompile");
    out.push_back({*json::as_string(key), *size, *hex});  // JSON object keys are strings
  }
  return out;
}

// The manifest of artifact directory `d` (spelled as Python prints it), with the cheap checks.
json::Object checked_manifest(const std::string& d, const std::string& path) {
  if (!is_dir(d)) throw ArtifactError(d + ": not an artifact directory (run `dsv4c compile` first)");
  std::string text, problem;
  if (int err = read_all(path, &text)) {
    if (err == ENOENT) throw ArtifactError(d + ": no manifest.json; not a dsv4c artifact or an interrupted compile");
    throw ArtifactError(path + ": unreadable manifest (" + os_error_name(err) + ")");
  }
  std::optional<json::Value> doc = json::parse(text, &problem);
  if (!doc) throw ArtifactError(path + ": unreadable manifest (JSONDecodeError)");
  std::optional<json::Object> manifest = json::as_object(*doc);
  // Python compares with ==, so 2.0 passes as version 2 too (and true, which is 1, does not).
  std::optional<json::Value> version = manifest ? manifest->Get(tvm::ffi::String("format_version")) : std::nullopt;
  std::optional<double> number = version ? json::as_number(*version) : std::nullopt;
  if (!(number && *number == kFormatVersion)) {
    throw ArtifactError(d + ": artifact format version " + (version ? json::py_repr(*version) : "None") +
                        ", this runtime reads " + std::to_string(kFormatVersion) + "; recompile");
  }
  for (const ListedFile& f : listed_files(*manifest, path)) {
    std::string file = join_path(d, f.name);
    struct stat st;
    if (::stat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
      throw ArtifactError(d + ": file " + f.name + " listed in the manifest is missing");
    }
    if (st.st_size != f.bytes) {
      throw ArtifactError(d + ": " + f.name + " has " + std::to_string(st.st_size) + " bytes, the manifest records " +
                          std::to_string(f.bytes) + " (truncated or modified); compile again or copy the artifact again");
    }
  }
  return *manifest;
}

// Hashes the listed files `keep` selects, in name order; the bytes checked.
template <typename Keep>
int64_t check_hashes(const std::string& d, const json::Object& manifest, const std::string& path, Keep keep) {
  std::vector<ListedFile> files = listed_files(manifest, path);
  std::sort(files.begin(), files.end(), [](const ListedFile& a, const ListedFile& b) { return a.name < b.name; });
  int64_t checked = 0;
  for (const ListedFile& f : files) {
    if (!keep(f.name)) continue;
    if (sha256_of_file(join_path(d, f.name)) != f.sha256) {
      throw ArtifactError(d + ": " + f.name + " does not match its sha256 in the manifest (modified or corrupt)");
    }
    checked += f.bytes;
  }
  return checked;
}

int64_t verify_files(const std::string& d, const json::Object& manifest, const std::string& path) {
  return check_hashes(d, manifest, path, [](const std::string&) { return true; });
}

// The large files the manifest lists, which loading does not hash: the weight shards
// (manifest["weights"]["files"]) and the Engram tables (manifest["engram"]["tables"][]["file"]).
std::vector<std::string> large_files(const json::Object& manifest) {
  auto member = [](const std::optional<json::Value>& v, const char* key) -> std::optional<json::Value> {
    std::optional<json::Object> object = v ? json::as_object(*v) : std::nullopt;
    return object ? object->Get(tvm::ffi::String(key)) : std::nullopt;
  };
  auto items = [](const std::optional<json::Value>& v) {
    std::optional<json::Array> array = v ? json::as_array(*v) : std::nullopt;
    return array ? *array : json::Array();
  };
  std::vector<std::string> out;
  for (const json::Value& f : items(member(manifest.Get(tvm::ffi::String("weights")), "files"))) {
    if (std::optional<std::string> name = json::as_string(f)) out.push_back(*name);
  }
  for (const json::Value& t : items(member(manifest.Get(tvm::ffi::String("engram")), "tables"))) {
    std::optional<json::Value> file = member(t, "file");
    if (std::optional<std::string> name = file ? json::as_string(*file) : std::nullopt) out.push_back(*name);
  }
  return out;
}

}  // namespace

json::Fields read_manifest(const std::string& directory, bool verify) {
  const std::string d = python_path(directory), path = join_path(d, "manifest.json");
  json::Object manifest = checked_manifest(d, path);
  if (verify) {
    verify_files(d, manifest, path);
  } else {
    // Every file but the weight shards and Engram tables is small: hashed at every load (Python:
    // read_manifest); the loaders check the large ones' headers.
    std::vector<std::string> large = large_files(manifest);
    check_hashes(d, manifest, path, [&](const std::string& name) {
      return std::find(large.begin(), large.end(), name) == large.end();
    });
  }
  return json::Fields(manifest, path);
}

int64_t verify_artifact(const std::string& directory) {
  const std::string d = python_path(directory), path = join_path(d, "manifest.json");
  return verify_files(d, checked_manifest(d, path), path);
}

}  // namespace dsv4c
