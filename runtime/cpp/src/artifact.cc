#include "artifact.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <sstream>

#include "dsv4c/errors.h"
#include "sha256.h"

namespace dsv4c {
namespace {

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool is_file(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
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

json::Fields read_manifest(const std::string& directory) {
  const std::string d = python_path(directory), path = join_path(d, "manifest.json");
  if (!is_dir(d)) throw ArtifactError(d + ": not an artifact directory (run `dsv4c compile` first)");
  std::string text, problem;
  if (int err = read_all(path, &text)) {
    if (err == ENOENT) throw ArtifactError(d + ": no manifest.json; not a dsv4c artifact or an interrupted compile");
    throw ArtifactError(path + ": unreadable manifest (" + os_error_name(err) + ")");
  }
  std::optional<json::Value> doc = json::parse(text, &problem);
  if (!doc) throw ArtifactError(path + ": unreadable manifest (JSONDecodeError)");
  std::optional<json::Object> manifest = json::as_object(*doc);
  // Python compares with ==, so 1.0 and true pass as version 1 too.
  std::optional<json::Value> version = manifest ? manifest->Get(tvm::ffi::String("format_version")) : std::nullopt;
  std::optional<double> number = version ? json::as_number(*version) : std::nullopt;
  bool is_true = version && version->type_index() == tvm::ffi::TypeIndex::kTVMFFIBool && version->cast<bool>();
  if (!(is_true || (number && *number == kFormatVersion))) {
    throw ArtifactError(d + ": artifact format version " + (version ? json::py_repr(*version) : "None") +
                        ", this runtime reads " + std::to_string(kFormatVersion) + "; recompile");
  }
  std::optional<json::Value> files = manifest->Get(tvm::ffi::String("files"));
  std::optional<json::Object> listed = files ? json::as_object(*files) : std::nullopt;
  if (!listed) throw ArtifactError(path + ": manifest has no file list; recompile");
  for (const auto& [key, digest] : *listed) {
    std::string name = *json::as_string(key);  // JSON object keys are strings
    std::string file = join_path(d, name);
    if (!is_file(file)) throw ArtifactError(d + ": file " + name + " listed in the manifest is missing");
    if (json::as_string(digest) != sha256_of_file(file)) {
      throw ArtifactError(d + ": " + name + " does not match its sha256 in the manifest (modified or corrupt)");
    }
  }
  return json::Fields(*manifest, path);
}

}  // namespace dsv4c
