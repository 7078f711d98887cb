// dsv4c C++ runtime: load a compiled CPU artifact and generate tokens, no Python involved.
//
//   dsv4c::Engine engine("/path/to/artifact");              // check, load kernels + weights, make the pool
//   int64_t id = engine.submit({1, 2, 3}, {/*max_new_tokens=*/8});
//   engine.run();                                           // or: while (engine.step()) {...}
//   dsv4c::Result r = engine.result(id);                    // r.tokens
//
// The engine is the C++ twin of dsv4c.runtime.engine.Engine: it calls the artifact's compiled
// step (the decode / prefill functions of model.so, through TVM's Relax VM) with the same
// inputs as runtime/backend_tvm.py, so tokens and logits equal the Python runtime's (see
// docs/cpp_host.md). Sampling is greedy (argmax, the lowest id wins ties).
//
// Errors: every user error is a dsv4c::Error subclass (errors.h) whose what() is the message the
// Python runtime gives for the same mistake. A tvm::ffi::Error from inside a kernel means a bug.
//
// Ownership: an Engine owns everything it loads (the kernel library, the weights, the KV pool);
// Results are plain values owned by the caller. Engines are movable, not copyable.
//
// Thread-safety: an Engine is not thread-safe; use one Engine per thread (or guard it with a
// mutex). Distinct Engines share nothing but the read-only artifact files and may run
// concurrently. Token callbacks run on the thread that calls step() / run().
#ifndef DSV4C_RUNTIME_H_
#define DSV4C_RUNTIME_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dsv4c/errors.h"
#include "dsv4c/kv_pool.h"

namespace dsv4c {

/// Scheduling limits (Python: Engine(...) keyword arguments, same defaults).
struct EngineOptions {
  int64_t max_step_tokens = 512;         // tokens per step, decodes first, then prefill chunks
  std::optional<int64_t> prefill_chunk;  // at most this many prompt tokens per step; unset: no limit
  int64_t max_requests = 8;              // requests in the pool at once (later ones wait)
  int64_t max_context = 4096;            // prompt + new tokens of one request; sizes the pool
  // "map" the weight files, "read" them into memory (on the CPU, huge pages: faster decode), or
  // "auto": read on the CPU when they take at most half of MemAvailable, map otherwise.
  std::string weights = "auto";
  // A DeepSeek-V4.1 model's Engram tables: "map" their files (the pages a step's rows lie on load
  // as read) or "read" them into memory. No effect for models without Engram tables.
  std::string engram_memory = "map";
  // Off the CPU each step uploads only the Engram table rows its tokens read (the tables stay in
  // host memory); true takes that path on the CPU too, which otherwise passes the whole tables
  // (a check that both give the same logits).
  bool gather_engram_rows = false;
  // On the CPU, seconds between two returns of the buffers the VM's pooled allocator keeps for
  // reuse (it keeps one for every step shape it has seen, so requests of every length grow it),
  // with glibc's freed pages (malloc_trim); the next step allocates its buffers again. 0: before
  // every step. As the Python runtime (runtime.tvm_runtime.release_cached_memory).
  double release_cached_memory_every = 30.0;
};

/// What to generate for one request (greedy decoding).
struct GenerationParams {
  int64_t max_new_tokens = 32;
  std::vector<int32_t> stop_token_ids;  // stop after generating any of these
  bool record_logits = false;           // keep the logits of every token fed (see Result)
};

/// Called with (request id, token id) as soon as a token is generated.
using TokenCallback = std::function<void(int64_t, int32_t)>;

struct Result {
  std::vector<int32_t> tokens;  // the generated ids
  /// With record_logits: row-major float32 [rows, vocab_size], one row per token fed (the
  /// prompt, then every generated token, the last one included), as `dsv4c generate
  /// --logits-out` saves them. Empty otherwise.
  std::vector<float> logits;
  int64_t rows = 0;
};

/// One image's span rows from Engine::encode_image: row-major float32 [tokens, width] (width: the
/// text model's hidden size), in prompt order: image_start, each row of the aligner's grid and
/// its image_newline, image_end (docs/vision.md).
struct ImageRows {
  std::vector<float> rows;
  int64_t tokens = 0;
  int64_t width = 0;
};

/// Checks every file of an artifact against the sha256 its manifest records (reads every byte;
/// Python: `dsv4c verify`). Returns the bytes checked; throws ArtifactError naming the first file
/// that does not match (or what read_manifest finds first: a missing or resized file).
int64_t verify_artifact(const std::string& artifact);

class Engine {
 public:
  /// Loads the artifact directory written by `dsv4c compile`: checks the format version, the size
  /// of every file and the sha256 of all but the weight shards and Engram tables (see
  /// verify_artifact), opens model.so through the TVM runtime (a GPU artifact on a host with that
  /// GPU), maps or reads the weights (as options.weights says) and uploads them, maps or reads a
  /// DeepSeek-V4.1 model's Engram tables and loads its Engram hash, and allocates the KV pool for
  /// `options`. Throws ArtifactError / CheckpointError / UsageError with the Python runtime's
  /// messages.
  explicit Engine(const std::string& artifact, const EngineOptions& options = {});
  ~Engine();
  Engine(Engine&&) noexcept;
  Engine& operator=(Engine&&) noexcept;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Queues a request and returns its id (0, 1, 2, ... per engine). Nothing runs until step().
  /// Throws UsageError for an empty prompt, an id outside the vocabulary, a negative
  /// max_new_tokens or prompt + max_new_tokens > max_context. `on_token` may be empty.
  int64_t submit(const std::vector<int32_t>& prompt, const GenerationParams& params,
                 TokenCallback on_token = nullptr);

  /// Runs one step of the compiled step function over a batch: one decode token of every running
  /// request, then prefill chunks of waiting ones, within max_step_tokens. Admits requests to the
  /// pool and frees finished ones. Returns false when there was nothing to run.
  /// Throws PoolExhausted when the pool cannot hold the batch.
  bool step();
  /// step() until every submitted request has finished.
  void run();

  // The three calls below throw UsageError for an id that submit() did not return or whose
  // result was already taken.
  bool finished(int64_t request) const;
  /// Tokens generated so far (valid until the next step() or result()).
  const std::vector<int32_t>& tokens(int64_t request) const;
  /// The request's tokens and logits; forgets the request. Call it once the request finished.
  Result result(int64_t request);
  /// submit + run + result.
  Result generate(const std::vector<int32_t>& prompt, const GenerationParams& params,
                  TokenCallback on_token = nullptr);

  /// Runs the artifact's vision tower (a DeepSeek-V4.1 model compiled with its vision_config) on
  /// one image the host prepared: `pixels` row-major float32 [3, height, width], RGB, normalized
  /// as (value / 255 - 0.5) / 0.5, height and width multiples of the patch size (the manifest's
  /// "vision": resizing, padding and the token budget are the host's, docs/cpp_host.md). Returns
  /// the rows that replace the span's image_token_id positions in the prompt. Throws UsageError
  /// without a tower or for pixels it cannot take (Python: TvmBackend.encode_image's messages).
  ImageRows encode_image(const std::vector<float>& pixels, int64_t height, int64_t width) const;
  int64_t vocab_size() const;
  /// The artifact path as messages spell it (normalised like Python's pathlib).
  const std::string& path() const;
  /// The KV pool (read-only: the engine admits, grows and frees requests itself).
  const KVPool& pool() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dsv4c

#endif  // DSV4C_RUNTIME_H_
