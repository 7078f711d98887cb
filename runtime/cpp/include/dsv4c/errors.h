// Errors of the dsv4c C++ runtime.
//
// Every error a user can cause (a missing or tampered artifact, bad arguments, a full KV pool)
// is thrown as a subclass of dsv4c::Error whose what() is one line, the same text the Python
// runtime puts in the matching DsvError subclass (dsv4c/errors.py, artifact/manifest.py,
// runtime/kv_pool.py). A host prints it the way `dsv4c` does: "dsv4c: error: <what()>".
// Anything else that escapes the runtime (std::bad_alloc, a tvm::ffi::Error raised inside a
// kernel) is a bug or an environment problem, not a user error.
#ifndef DSV4C_ERRORS_H_
#define DSV4C_ERRORS_H_

#include <stdexcept>

namespace dsv4c {

/// Base of every user-facing error (Python: DsvError).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The artifact is missing, tampered with, of another format version or for another host.
class ArtifactError : public Error {
 public:
  using Error::Error;
};

/// weights.safetensors is unreadable or inconsistent.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

/// An API call was made with invalid arguments.
class UsageError : public Error {
 public:
  using Error::Error;
};

/// The KV pool has no room for a request; the pool is unchanged.
class PoolExhausted : public Error {
 public:
  using Error::Error;
};

}  // namespace dsv4c

#endif  // DSV4C_ERRORS_H_
