"""The tensor / expert parallel plan: which slice of every weight each of ``N`` ranks holds
(``--tensor-parallel N``; docs/tensor_parallel.md).

One rule per weight, by its name (the IR's weight names: the official checkpoint names, routed
experts stacked ``[experts, out, in]`` as ``ffn.experts.w1``); a weight no rule names is
replicated. Split weights are cut along one axis into ``N`` contiguous equal ranges:

* attention heads: ``wq_b`` rows and ``attn_sink`` (head-major), the grouped output
  projection by groups (``wo_a`` rows, ``wo_b`` input columns: each rank's partial product is
  summed by an all-reduce), so ``N`` divides ``num_attention_heads`` and ``o_groups``;
* routed experts whole (expert parallel): rank ``r`` holds experts ``[r E/N, (r+1) E/N)``;
  or with ``--no-expert-parallel`` by their intermediate dim (``w1`` / ``w3`` rows of every
  expert, ``w2`` columns), like the shared expert, so that a decode token's k experts cost every
  rank the same (with whole experts they fall unevenly on the ranks); measured slower on the
  CPU (bench/RESULTS.md), where the smaller expert kernels lose more than the balance gains;
* the shared expert by its intermediate dim (``w1`` / ``w3`` rows, ``w2`` columns): its partial
  output joins the routed experts' all-reduce, so splitting it costs no extra collective and
  saves ``(N-1)/N`` of its bytes on every rank;
* embedding and LM head by vocab rows, in ranges of ``ceil(vocab / N)``: a vocab ``N`` does not
  divide is padded (the last rank's buffer has rows no token id reaches and no logit wins),
  because vocab sizes are arbitrary where head counts are not.

Replicated: norms, mHC, the router (every rank routes every token), ``wq_a`` (every head reads
``q_res``), ``wkv`` and the compressors: V4 has one KV head (``num_key_value_heads = 1``), so
the latent and the compressed KV are computed and stored on every rank, and the pool per
device is the whole pool. The indexer's query side (``wq_b``, ``weights_proj``) too, as the
production V4 deployments keep it: its score is one sum over all index heads, so split heads
would need an all-reduce of ``[T, visible entries]`` scores in every CSA layer (1 MiB per token
per layer at 1M context) to save 12.6 M parameters a layer. MTP's ``e_proj`` / ``h_proj`` (two ``D x D`` matrices) stay whole
rather than add an all-gather to every draft.

DeepSeek-V4.1 splits by the same rules (its attention, MoE, embedding and head weights have V4's
names); its own parts are replicated: the shared compressor and the index keys it writes (one KV
head, like V4's compressors), every index source's query side (re-index layers included), the
candidate blocks (per query, from the replicated scores), the delayed mHC collapse and Engram
(table, ``wkv``, gates: it writes into the streams every rank holds whole).

``N`` is a power of two (the 2, 4, 8 devices of a node's NVLink / xGMI domain, and the doubling
``min_devices`` searches), columns split from FP8 block weights stay whole blocks and
those of FP4 experts whole 32-column scale groups.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dsv4c.artifact.model_config import ModelConfig
from dsv4c.artifact.pool import PoolGeometry
from dsv4c.artifact.quant import FP4_GROUP, WeightFormat
from dsv4c.errors import ShardingError

# Per-rank int weights (rank_values), not from a checkpoint: a rank's first vocab row and expert.
VOCAB_FIRST, EXPERT_FIRST = RANK_VALUES = ("tp.vocab_first", "tp.expert_first")
# The collectives a multi-rank step calls as packed functions (input, output), registered by the
# runtime (runtime.tensor_parallel): the sum of every rank's tensor, and the ranks' columns side
# by side (the vocab-split logits).
ALL_REDUCE, ALL_GATHER = "dsv4c.all_reduce", "dsv4c.all_gather"
MIN_DEVICES_CONTEXT = 131072  # the one request `inspect --memory` sizes min_devices for

# What a split weight is cut by.
HEADS, O_GROUPS, EXPERTS, ROUTED_INTER, SHARED_INTER, VOCAB = (
    "attention heads", "output groups", "routed experts", "routed expert intermediate", "shared expert intermediate",
    "vocab")

# (name pattern, axis, unit): the first match rules; no match is replicated.
_RULES = [(re.compile(pattern), axis, unit) for pattern, axis, unit in (
    (r"(^|\.)attn\.wq_b\.weight$", 0, HEADS),
    (r"(^|\.)attn\.attn_sink$", 0, HEADS),
    (r"(^|\.)attn\.wo_a\.weight$", 0, O_GROUPS),
    (r"(^|\.)attn\.wo_b\.weight$", 1, O_GROUPS),
    (r"(^|\.)ffn\.experts\.w[13]$", 1, ROUTED_INTER),
    (r"(^|\.)ffn\.experts\.w2$", 2, ROUTED_INTER),
    (r"(^|\.)ffn\.shared_experts\.w[13]\.weight$", 0, SHARED_INTER),
    (r"(^|\.)ffn\.shared_experts\.w2\.weight$", 1, SHARED_INTER),
    (r"^(embed|head)\.weight$", 0, VOCAB),
)]
# With expert parallel (the default) the routed experts' rule is this one: whole experts per rank.
_EXPERT_PARALLEL = (re.compile(r"(^|\.)ffn\.experts\.w[123]$"), 0, EXPERTS)


@dataclass(frozen=True)
class WeightShard:
    """What one rank holds of one weight: ``[start, stop)`` along ``axis`` (None: all of it), in
    a buffer ``extent`` long on that axis (longer than the range only in a padded vocab split)."""
    axis: int | None
    start: int
    stop: int
    extent: int

    def held_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.axis is None:
            return tuple(shape)
        return tuple(self.extent if i == self.axis else n for i, n in enumerate(shape))


@dataclass(frozen=True)
class ShardingPlan:
    cfg: ModelConfig
    tensor_parallel: int
    expert_parallel: bool = True

    @classmethod
    def build(cls, cfg: ModelConfig, tensor_parallel: int, expert_parallel: bool = True) -> ShardingPlan:
        """The plan for ``tensor_parallel`` ranks (``expert_parallel``: routed experts whole, a
        share of them per rank; else a share of every expert's intermediate dim); a
        :class:`ShardingError` (one line) where the model does not split so."""
        n = tensor_parallel
        if n < 1 or n & (n - 1):
            raise ShardingError(f"--tensor-parallel {n}: the device count must be a power of two (1, 2, 4, 8, ...)")
        if n == 1:
            return cls(cfg, n)
        dense_fp8 = cfg.weights.dense == "fp8"
        must_divide = [(HEADS, "num_attention_heads", cfg.num_heads), (O_GROUPS, "o_groups", cfg.o_groups),
                       (SHARED_INTER, "moe_intermediate_size", cfg.moe_intermediate_size)]
        if expert_parallel:
            must_divide.append((EXPERTS, "n_routed_experts", cfg.n_routed_experts))
        for unit, field, size in must_divide:
            if size % n:
                raise ShardingError(f"--tensor-parallel {n}: {cfg.name} does not split its {unit} across {n} devices "
                                    f"({field} = {size} is not a multiple of {n})")
        # Columns of FP8 weights are cut between their column blocks' scales, never inside one.
        block = cfg.weights.fp8_block
        column_splits = [("wo_b", "o_groups * o_lora_rank", cfg.o_groups * cfg.o_lora_rank),
                         ("shared expert w2", "moe_intermediate_size", cfg.moe_intermediate_size)]
        for weight, field, cols in column_splits if dense_fp8 else ():
            if (cols // n) % block:
                raise ShardingError(f"--tensor-parallel {n}: {cfg.name}'s {weight} would split inside its FP8 "
                                    f"{block}-column scale blocks ({field} = {cols}, {cols // n} columns per device)")
        # The routed experts' w2 columns split between their scale groups (FP4: 32, FP8: a block).
        group = {"fp4": FP4_GROUP, "fp8": block}.get(cfg.weights.experts, 1)
        if not expert_parallel and (cfg.moe_intermediate_size // n) % group:
            raise ShardingError(f"--tensor-parallel {n}: {cfg.name}'s routed expert w2 would split inside its "
                                f"{group}-column scale groups (moe_intermediate_size = {cfg.moe_intermediate_size}); "
                                "leave out --no-expert-parallel")
        return cls(cfg, n, expert_parallel)

    def split_of(self, name: str) -> tuple[int, str] | None:
        """(axis, unit) a weight is split along, or None where every rank holds all of it."""
        if self.expert_parallel and _EXPERT_PARALLEL[0].search(name):
            return _EXPERT_PARALLEL[1:]
        for pattern, axis, unit in _RULES:
            if pattern.search(name):
                return axis, unit
        return None

    def shard(self, name: str, shape: tuple[int, ...], rank: int) -> WeightShard:
        """The part of weight ``name`` (of ``shape``) that ``rank`` holds."""
        split = self.split_of(name) if self.tensor_parallel > 1 else None
        if split is None:
            return WeightShard(None, 0, shape[0], shape[0])
        axis, unit = split
        size = shape[axis]
        if unit != VOCAB and size % self.tensor_parallel:  # build() checked the config: a mismatch is a bug
            raise AssertionError(f"{name} {shape}: axis {axis} does not split in {self.tensor_parallel}")
        extent = -(-size // self.tensor_parallel)
        start = min(size, rank * extent)
        return WeightShard(axis, start, min(size, start + extent), extent)

    def rank_values(self, rank: int) -> dict[str, int]:
        """What tells rank ``rank``'s step which vocab rows and experts it holds (the program's
        ``tp.*`` int weights, read by its ``shard_ids``): the first of each."""
        vocab = self.shard("embed.weight", (self.cfg.vocab_size, 1), rank)
        first_expert = rank * self.cfg.n_routed_experts // self.tensor_parallel if self.expert_parallel else 0
        return dict(zip(RANK_VALUES, (vocab.start, first_expert)))

    def device_weight_bytes(self, weights: list[tuple[str, tuple[int, ...], WeightFormat]]) -> int:
        """Bytes of weights the fullest rank holds, given every stored weight as (name, shape,
        the format the artifact stores it in)."""
        return max(sum(fmt.nbytes(self.shard(name, shape, rank).held_shape(shape)) for name, shape, fmt in weights)
                   for rank in range(self.tensor_parallel))


def min_devices(cfg: ModelConfig, weights: list[tuple[str, tuple[int, ...], WeightFormat]],
                geometry: PoolGeometry, memory_bytes: int, context: int = MIN_DEVICES_CONTEXT) -> int | None:
    """The fewest devices of ``memory_bytes`` each that hold their share of the weights and the
    pool of one request of ``context`` tokens (every rank stores the whole pool), or None where
    no count the model splits into is enough."""
    n = 1
    while True:
        try:
            plan = ShardingPlan.build(cfg, n)
        except ShardingError:  # past the largest count this model splits into
            return None
        if plan.device_weight_bytes(weights) + geometry.request_bytes(context) <= memory_bytes:
            return n
        n *= 2
