// The KV pool allocator and row maps; see include/dsv4c/kv_pool.h.
#include "dsv4c/kv_pool.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>

#include "dsv4c/errors.h"

namespace dsv4c {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Remove the first occurrence of `value`, as Python's list.remove does.
void remove_first(std::vector<int64_t>& list, int64_t value) {
  list.erase(std::find(list.begin(), list.end(), value));
}

bool contains(const std::vector<int64_t>& list, int64_t value) {
  return std::find(list.begin(), list.end(), value) != list.end();
}

// The `n` smallest entries of `list`, ascending (Python: sorted(list)[:n]).
std::vector<int64_t> smallest(std::vector<int64_t> list, int64_t n) {
  std::sort(list.begin(), list.end());
  list.resize(std::min<size_t>(list.size(), static_cast<size_t>(n)));
  return list;
}

}  // namespace

const CompressedLayerRows& PoolGeometry::rows_of(int64_t layer) const {
  for (const CompressedLayerRows& c : compressed) {
    if (std::find(c.readers.begin(), c.readers.end(), layer) != c.readers.end()) return c;
  }
  throw std::out_of_range("layer " + std::to_string(layer) + " has no compressed rows");
}

int64_t PoolGeometry::rows_for(int64_t requests, int64_t context_tokens) const {
  return requests * ceil_div(context_tokens, kEnvelopeTokens) * rows_per_envelope + requests * window_rows_per_request();
}

// The constructor's first check, run before any plane is allocated.
static int64_t checked_total_rows(const PoolGeometry& g, int64_t total_rows) {
  if (total_rows < g.window_rows_per_request()) {
    throw UsageError("a pool of " + std::to_string(total_rows) + " rows cannot hold even one request's windows (" +
                     std::to_string(g.window_rows_per_request()) + " rows)");
  }
  return total_rows;
}

KVPool::KVPool(PoolGeometry geometry, int64_t total_rows)
    : geometry_(std::move(geometry)),
      total_rows_(checked_total_rows(geometry_, total_rows)),
      max_envelopes_(geometry_.rows_per_envelope ? total_rows / geometry_.rows_per_envelope : 0),
      max_slots_(total_rows / geometry_.window_rows_per_request()),
      index_rows_(std::max<int64_t>(max_envelopes_ * geometry_.index_rows_per_envelope, 1)) {}

bool KVPool::fits(int64_t env_high, int64_t slot_high) const {
  return env_high * geometry_.rows_per_envelope <= total_rows_ - slot_high * geometry_.window_rows_per_request();
}

int64_t KVPool::free_envelopes() const {
  const PoolGeometry& g = geometry_;
  if (!g.rows_per_envelope) return 0;
  int64_t room = (total_rows_ - slot_high_ * g.window_rows_per_request()) / g.rows_per_envelope;
  return static_cast<int64_t>(env_free_.size()) + std::max<int64_t>(0, room - env_high_);
}

std::pair<std::vector<int64_t>, std::vector<int64_t>> KVPool::take(int64_t n_env, int64_t n_slots) {
  // Freed envelopes and slots first, lowest numbers first; then raise the high-water marks.
  std::vector<int64_t> envs = smallest(env_free_, n_env);
  std::vector<int64_t> slots = smallest(slot_free_, n_slots);
  int64_t env_high = env_high_ + n_env - static_cast<int64_t>(envs.size());
  int64_t slot_high = slot_high_ + n_slots - static_cast<int64_t>(slots.size());
  if (!fits(env_high, slot_high)) {
    throw PoolExhausted("KV pool exhausted: need " + std::to_string(n_env) + " envelope(s) and " +
                        std::to_string(n_slots) + " slot(s), " + std::to_string(free_envelopes()) +
                        " envelope(s) free; free a request or give the pool more memory");
  }
  for (int64_t e : envs) remove_first(env_free_, e);
  for (int64_t s : slots) remove_first(slot_free_, s);
  for (int64_t e = env_high_; e < env_high; ++e) envs.push_back(e);
  for (int64_t s = slot_high_; s < slot_high; ++s) slots.push_back(s);
  env_high_ = env_high;
  slot_high_ = slot_high;
  return {envs, slots};
}

const RequestRows& KVPool::admit(int64_t seq, int64_t reserve_tokens) {
  if (requests_.count(seq)) throw UsageError("request " + std::to_string(seq) + " is already in the pool");
  if (reserve_tokens < 0) throw UsageError("reserve_tokens must be >= 0, got " + std::to_string(reserve_tokens));
  int64_t n_env = geometry_.rows_per_envelope ? ceil_div(reserve_tokens, kEnvelopeTokens) : 0;
  auto [envs, slots] = take(n_env, 1);
  // The slot's compressor rings are emptied on the device by the step that feeds position 0.
  return requests_[seq] = RequestRows{slots.front(), std::move(envs)};
}

void KVPool::ensure(int64_t seq, int64_t tokens) {
  RequestRows& req = mutable_request(seq);
  if (!geometry_.rows_per_envelope) return;
  int64_t need = ceil_div(tokens, kEnvelopeTokens) - static_cast<int64_t>(req.blocks.size());
  if (need > 0) {
    std::vector<int64_t> envs = take(need, 0).first;
    req.blocks.insert(req.blocks.end(), envs.begin(), envs.end());
  }
}

void KVPool::free(int64_t seq) {
  RequestRows req = mutable_request(seq);
  requests_.erase(seq);
  env_free_.insert(env_free_.end(), req.blocks.begin(), req.blocks.end());
  slot_free_.push_back(req.slot);
  // Give the high-water marks back so the other region can use the rows.
  while (env_high_ && contains(env_free_, env_high_ - 1)) remove_first(env_free_, --env_high_);
  while (slot_high_ && contains(slot_free_, slot_high_ - 1)) remove_first(slot_free_, --slot_high_);
}

const RequestRows& KVPool::request(int64_t seq) const {
  auto it = requests_.find(seq);
  if (it == requests_.end()) throw UsageError("request " + std::to_string(seq) + " is not in the pool");
  return it->second;
}

RequestRows& KVPool::mutable_request(int64_t seq) { return const_cast<RequestRows&>(request(seq)); }

}  // namespace dsv4c
