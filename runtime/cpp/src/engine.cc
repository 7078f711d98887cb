// The engine: scheduling, greedy sampling and the request lifecycle of
// dsv4c/runtime/engine.py, on the artifact's compiled step.
#include <algorithm>
#include <cmath>
#include <iterator>
#include <map>
#include <optional>
#include <tuple>

#include "artifact.h"
#include "dsv4c/runtime.h"
#include "engram.h"
#include "model_config.h"
#include "safetensors.h"
#include "step.h"

namespace dsv4c {
namespace {

struct Request {
  int64_t id = 0;
  size_t prompt_length = 0;
  std::vector<int32_t> sequence;  // prompt, then generated tokens
  std::vector<int32_t> generated;
  GenerationParams params;
  TokenCallback on_token;
  int64_t fed = 0;  // tokens of the sequence already run through the model
  std::vector<float> logits;
  bool done_sampling = false;
  bool finished = false;

  int64_t pending() const { return static_cast<int64_t>(sequence.size()) - fed; }
};

// np.argmax: the first maximum, or the first NaN if there is one.
int32_t argmax(const float* logits, int64_t count) {
  int64_t best = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (std::isnan(logits[i])) return static_cast<int32_t>(i);
    if (logits[i] > logits[best]) best = i;
  }
  return static_cast<int32_t>(best);
}

// Refuses an option outside its `modes` with the Python message ("weights mode 'x' is not one of ...").
template <size_t N>
void check_mode(const std::string& option, const std::string& mode, const char* const (&modes)[N]) {
  if (std::find(std::begin(modes), std::end(modes), mode) != std::end(modes)) return;
  std::string names;
  for (const char* name : modes) names += (names.empty() ? "" : ", ") + std::string(name);
  throw UsageError(option + " mode " + json::py_repr(tvm::ffi::String(mode)) + " is not one of " + names);
}

}  // namespace

struct Engine::Impl {
  std::string path;
  EngineOptions options;
  ModelConfig config;
  std::unique_ptr<KVPool> pool;
  std::unique_ptr<CompiledStep> compiled_step;
  std::optional<EngramHash> engram;  // a V4.1 step's Engram hash: rows from each request's tokens
  std::map<int64_t, Request> requests;  // by id: submission order
  int64_t next_id = 0;

  Request& request(int64_t id) {
    auto it = requests.find(id);
    if (it == requests.end()) {
      throw UsageError("request " + std::to_string(id) + " is unknown (never submitted, or its result was taken)");
    }
    return it->second;
  }

  // (request, tokens to feed) for the next step: running decodes first, then prefill chunks.
  std::vector<std::pair<Request*, int64_t>> schedule() {
    int64_t budget = options.max_step_tokens;
    std::vector<Request*> live;
    for (auto& [id, r] : requests) {
      if (!r.finished) live.push_back(&r);
    }
    std::stable_sort(live.begin(), live.end(), [](const Request* a, const Request* b) {
      return std::make_tuple(a->fed < static_cast<int64_t>(a->prompt_length), a->id) <
             std::make_tuple(b->fed < static_cast<int64_t>(b->prompt_length), b->id);
    });
    std::vector<std::pair<Request*, int64_t>> plan;
    for (Request* r : live) {
      if (r->pending() == 0 || budget == 0) continue;
      if (!pool->requests().count(r->id)) {
        if (static_cast<int64_t>(pool->requests().size()) >= options.max_requests) continue;
        pool->admit(r->id, static_cast<int64_t>(r->prompt_length));
      }
      int64_t n = std::min({r->pending(), budget, options.prefill_chunk.value_or(r->pending())});
      plan.emplace_back(r, n);
      budget -= n;
    }
    return plan;
  }

  // A request has been fed completely: sample its next token, or finish it.
  void advance(Request& r, const float* last_logits) {
    if (r.done_sampling) {  // logits were requested for the last generated token too: it has now been fed
      r.finished = true;
      pool->free(r.id);
      return;
    }
    int32_t token = argmax(last_logits, config.vocab_size);
    r.generated.push_back(token);
    r.sequence.push_back(token);
    if (r.on_token) r.on_token(r.id, token);
    const std::vector<int32_t>& stops = r.params.stop_token_ids;
    if (static_cast<int64_t>(r.generated.size()) >= r.params.max_new_tokens ||
        std::find(stops.begin(), stops.end(), token) != stops.end()) {
      r.done_sampling = true;
    }
    if (!(r.done_sampling && r.params.record_logits)) {
      r.finished = r.done_sampling;
      if (r.finished) pool->free(r.id);
    }
  }
};

Engine::Engine(const std::string& artifact, const EngineOptions& options) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  json::Fields manifest = read_manifest(artifact);
  m.path = python_path(artifact);
  m.options = options;
  m.config = model_config(manifest);
  // A multi-rank artifact (Python twin: runtime.tensor_parallel) needs a process per rank and the
  // collectives torch.distributed provides: the host stays one process on one device.
  if (std::optional<json::Value> ranks = manifest.get("tensor_parallel")) {
    std::optional<int64_t> n = json::as_int(*ranks);
    throw ArtifactError(m.path + ": compiled with --tensor-parallel " + (n ? std::to_string(*n) : "?") +
                        "; the C++ runtime runs one-device artifacts: run it with `dsv4c generate` or `dsv4c serve` "
                        "(a process per rank), or compile it with --tensor-parallel 1");
  }
  PoolGeometry geometry = pool_geometry(manifest, m.config);
  m.pool = std::make_unique<KVPool>(geometry, geometry.rows_for(options.max_requests, options.max_context));
  if (manifest.string("target") == "reference") {
    throw ArtifactError(m.path + ": a reference artifact runs in the Python interpreter only; compile with "
                        "--target llvm for the C++ runtime");
  }
  if (options.max_step_tokens < 1 || (options.prefill_chunk && *options.prefill_chunk < 1)) {
    throw UsageError("max_step_tokens and prefill_chunk must be positive");
  }
  check_mode("weights", options.weights, kWeightsModes);
  check_mode("Engram memory", options.engram_memory, kEngramMemoryModes);
  int64_t limit = manifest.object("vm").integer("max_step_tokens");
  if (options.max_step_tokens > limit) {
    throw UsageError("max_step_tokens " + std::to_string(options.max_step_tokens) + " exceeds what " + m.path +
                     " was compiled for (" + std::to_string(limit) + "); lower it");
  }
  if (!(options.release_cached_memory_every >= 0)) {
    throw UsageError("release_cached_memory_every must be a number of seconds >= 0");
  }
  m.compiled_step = std::make_unique<CompiledStep>(m.path, manifest, *m.pool, options.weights, options.engram_memory,
                                                   options.gather_engram_rows, options.release_cached_memory_every);
  if (m.compiled_step->takes_engram_rows()) m.engram = load_engram_hash(m.path, manifest);
}

Engine::~Engine() = default;
Engine::Engine(Engine&&) noexcept = default;
Engine& Engine::operator=(Engine&&) noexcept = default;

int64_t Engine::submit(const std::vector<int32_t>& prompt, const GenerationParams& params, TokenCallback on_token) {
  Impl& m = *impl_;
  if (params.max_new_tokens < 0) {
    throw UsageError("max_new_tokens must be >= 0, got " + std::to_string(params.max_new_tokens));
  }
  if (prompt.empty()) throw UsageError("the prompt is empty; give at least one token");
  for (int32_t t : prompt) {
    if (t < 0 || t >= m.config.vocab_size) {
      throw UsageError("token id " + std::to_string(t) + " is outside the vocabulary [0, " +
                       std::to_string(m.config.vocab_size) + ")");
    }
  }
  if (static_cast<int64_t>(prompt.size()) + params.max_new_tokens > m.options.max_context) {
    throw UsageError("prompt (" + std::to_string(prompt.size()) + ") + max_new_tokens (" +
                     std::to_string(params.max_new_tokens) + ") exceeds the engine's max_context (" +
                     std::to_string(m.options.max_context) + ")");
  }
  Request r;
  r.id = m.next_id++;
  r.prompt_length = prompt.size();
  r.sequence = prompt;
  r.params = params;
  r.on_token = std::move(on_token);
  if (params.max_new_tokens == 0 && !params.record_logits) r.done_sampling = r.finished = true;
  int64_t id = r.id;
  m.requests.emplace(id, std::move(r));
  return id;
}

bool Engine::step() {
  Impl& m = *impl_;
  std::vector<std::pair<Request*, int64_t>> plan = m.schedule();
  if (plan.empty()) return false;
  std::vector<int32_t> tokens, positions, seq_ids, logit_rows;
  EngramRows engram_rows;
  if (m.engram) engram_rows.layers = m.engram->layers(), engram_rows.per_layer = m.engram->rows_per_layer();
  for (auto [r, n] : plan) {
    m.pool->ensure(r->id, r->fed + n);
    // Hashed from the request's own tokens, so the rows are exact whatever the chunking.
    if (m.engram) m.engram->request_rows(r->sequence, r->fed, r->fed + n, engram_rows.rows);
    const int32_t start = static_cast<int32_t>(tokens.size());
    for (int64_t i = r->fed; i < r->fed + n; ++i) {
      tokens.push_back(r->sequence[i]);
      positions.push_back(static_cast<int32_t>(i));
      seq_ids.push_back(static_cast<int32_t>(r->id));
    }
    // Only the logits the engine uses come back: every row when recorded, else the last row of a
    // request whose sequence this step completes.
    if (r->params.record_logits) {
      for (int32_t i = 0; i < n; ++i) logit_rows.push_back(start + i);
    } else if (r->pending() == n) {
      logit_rows.push_back(start + static_cast<int32_t>(n) - 1);
    }
  }
  std::vector<float> logits = m.compiled_step->run(tokens, positions, seq_ids, logit_rows, engram_rows);
  const int64_t vocab = m.config.vocab_size;
  const float* row = logits.data();
  for (auto [r, n] : plan) {
    const int64_t rows = r->params.record_logits ? n : r->pending() == n ? 1 : 0;
    r->fed += n;
    if (r->params.record_logits) r->logits.insert(r->logits.end(), row, row + n * vocab);
    if (r->pending() == 0) m.advance(*r, row + (rows - 1) * vocab);
    row += rows * vocab;
  }
  return true;
}

void Engine::run() {
  while (step()) {
  }
}

bool Engine::finished(int64_t request) const { return impl_->request(request).finished; }

const std::vector<int32_t>& Engine::tokens(int64_t request) const { return impl_->request(request).generated; }

Result Engine::result(int64_t request) {
  Request& r = impl_->request(request);
  Result out{std::move(r.generated), std::move(r.logits), 0};
  out.rows = static_cast<int64_t>(out.logits.size()) / impl_->config.vocab_size;
  impl_->requests.erase(request);
  return out;
}

Result Engine::generate(const std::vector<int32_t>& prompt, const GenerationParams& params, TokenCallback on_token) {
  int64_t id = submit(prompt, params, std::move(on_token));
  run();
  return result(id);
}

ImageRows Engine::encode_image(const std::vector<float>& pixels, int64_t height, int64_t width) const {
  return impl_->compiled_step->encode_image(pixels, height, width);
}
int64_t Engine::vocab_size() const { return impl_->config.vocab_size; }
const std::string& Engine::path() const { return impl_->path; }
const KVPool& Engine::pool() const { return *impl_->pool; }

}  // namespace dsv4c
