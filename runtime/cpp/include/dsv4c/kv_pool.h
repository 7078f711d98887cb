// The KV pool: one row space per device, the C++ twin of dsv4c/runtime/kv_pool.py.
//
// * Envelopes hold compressed history: one envelope covers 256 tokens of one request and
//   holds, compressor group by group, the group's compressed rows (256 / ratio each): a group
//   is a KV source and the layers that attend its rows. They are allocated from row 0 upward.
// * Slots hold a live request's sliding windows (`window` rows per layer, a ring indexed by
//   position % window); they are allocated from the top of the row space downward.
// * Index keys (of a group whose source runs an indexer) live in a separate index pool
//   addressed by the same envelope numbers; compressor rings are fp32, one set per slot.
// Groups and rings are read from the manifest as recorded (Python: PoolGeometry), whatever
// model family made them.
//
// This class is the allocator only: which rows a request owns. The memory (planes and rings,
// on the artifact's device) belongs to the compiled step, whose kernels turn slots and block
// tables into rows. The allocator (admit / ensure / free and the free lists) makes exactly the
// decisions of the Python KVPool; tests/test_cpp_host.py drives both through the same
// operation traces and compares every state (see docs/cpp_host.md for why there are two).
//
// Thread-safety: none; a pool belongs to one Engine, which belongs to one thread at a time.
#ifndef DSV4C_KV_POOL_H_
#define DSV4C_KV_POOL_H_

#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace dsv4c {

/// Tokens covered by one envelope.
inline constexpr int64_t kEnvelopeTokens = 256;

/// Where one compressor group's rows sit inside an envelope: KV source `layer`'s, attended by
/// every layer of `readers` (the source first).
struct CompressedLayerRows {
  int64_t layer = 0;
  int64_t ratio = 0;
  int64_t rows_per_envelope = 0;  // 256 / ratio
  int64_t offset = 0;             // first row of this group inside an envelope
  int64_t index_offset = -1;      // first row inside an index envelope; -1 without index keys
  std::vector<int64_t> readers;
};

/// The compressor ring of one (layer, stream): `rows` x `width` fp32 per slot, kv and score.
struct StateShape {
  int64_t layer = 0;
  std::string stream;  // "main" or "index"
  int64_t rows = 0;    // ratio, or 2 * ratio where the compressor pools overlapping windows
  int64_t width = 0;   // head_dim, or 2 * head_dim with overlapping windows
};

/// Every number of the pool, computed once (Python: PoolGeometry).
struct PoolGeometry {
  int64_t window = 0;
  int64_t window_layers = 0;  // the backbone's layers, then the MTP layers
  std::vector<CompressedLayerRows> compressed;
  std::vector<StateShape> states;
  int64_t rows_per_envelope = 0;
  int64_t index_rows_per_envelope = 0;

  int64_t window_rows_per_request() const { return window_layers * window; }
  /// Main rows for `requests` requests of up to `context_tokens` tokens each (envelopes for
  /// the context, plus each request's windows).
  int64_t rows_for(int64_t requests, int64_t context_tokens) const;
  /// The group whose rows `layer` attends; throws std::out_of_range for an uncompressed layer.
  const CompressedLayerRows& rows_of(int64_t layer) const;
};

/// A live request's rows: its window slot and its block table (envelope numbers, token order).
struct RequestRows {
  int64_t slot = 0;
  std::vector<int64_t> blocks;
};

class KVPool {
 public:
  /// A pool of `total_rows` main rows. Throws UsageError when one request's windows do not fit.
  KVPool(PoolGeometry geometry, int64_t total_rows);

  // ----- allocator (same decisions and messages as the Python KVPool)
  /// A slot for new request `seq`, plus envelopes for `reserve_tokens` tokens up front; resets
  /// the slot's rings. Throws UsageError if `seq` is already admitted, PoolExhausted (pool
  /// unchanged) if there is no room.
  const RequestRows& admit(int64_t seq, int64_t reserve_tokens = 0);
  /// Grow `seq`'s block table so that positions < `tokens` have envelopes.
  void ensure(int64_t seq, int64_t tokens);
  /// Return `seq`'s slot and envelopes; high-water marks shrink when the top ones are free.
  void free(int64_t seq);
  /// Envelopes that can still be allocated without moving any slot.
  int64_t free_envelopes() const;

  // ----- state (read-only views, for hosts and the conformance test)
  const PoolGeometry& geometry() const { return geometry_; }
  int64_t total_rows() const { return total_rows_; }
  int64_t max_envelopes() const { return max_envelopes_; }
  int64_t max_slots() const { return max_slots_; }
  const std::map<int64_t, RequestRows>& requests() const { return requests_; }
  /// `seq`'s rows; throws UsageError when it is not in the pool.
  const RequestRows& request(int64_t seq) const;
  int64_t env_high() const { return env_high_; }    // envelopes [0, env_high) may be in use
  int64_t slot_high() const { return slot_high_; }  // slots [0, slot_high) may be in use
  const std::vector<int64_t>& env_free() const { return env_free_; }
  const std::vector<int64_t>& slot_free() const { return slot_free_; }

  /// Rows of the index pool (index envelopes; at least one).
  int64_t index_rows() const { return index_rows_; }

 private:
  std::pair<std::vector<int64_t>, std::vector<int64_t>> take(int64_t n_env, int64_t n_slots);
  bool fits(int64_t env_high, int64_t slot_high) const;
  RequestRows& mutable_request(int64_t seq);

  PoolGeometry geometry_;
  int64_t total_rows_;
  int64_t max_envelopes_;
  int64_t max_slots_;
  int64_t index_rows_;
  std::map<int64_t, RequestRows> requests_;
  int64_t env_high_ = 0;
  int64_t slot_high_ = 0;
  std::vector<int64_t> env_free_;
  std::vector<int64_t> slot_free_;
};

}  // namespace dsv4c

#endif  // DSV4C_KV_POOL_H_
