"""The model description compiler and runtime share: one frozen :class:`ModelConfig`, and its
canonical JSON form (:meth:`ModelConfig.to_json_dict`, the manifest's ``model``, which the C++
host reads too, and :meth:`ModelConfig.from_json_dict`, its reader).

The frontend (``frontend.config``) parses and validates every spelling a model directory may
use; an artifact holds the transformers spelling this module writes, which is read back here
without re-validating it (the compiler did).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from dsv4c.errors import ArtifactError, ConfigError

SLIDING, CSA, HCA = "sliding", "csa", "hca"  # V4's layer kinds, named from the roles (LayerSpec.attention)
HASH_MOE, ROUTED_MOE = "hash", "routed"

HF_LAYER_TYPES = {
    "sliding_attention": SLIDING,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
HF_MLP_TYPES = {"hash_moe": HASH_MOE, "moe": ROUTED_MOE}


@dataclass(frozen=True)
class Yarn:
    """YaRN extension of the compressed-attention rope (docs/v4.md, "Forward pass")."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class Rope:
    theta: float
    yarn: Yarn | None = None

    def inv_freq(self, rope_dim: int) -> np.ndarray:
        """Per-pair inverse frequencies, float32, as ``transformers`` computes them
        (``attention_factor`` forced to 1.0 for YaRN, truncated correction range)."""
        exponent = np.arange(0, rope_dim, 2, dtype=np.float32) / np.float32(rope_dim)
        pos_freqs = np.power(np.float32(self.theta), exponent, dtype=np.float32)
        extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
        if self.yarn is None:
            return extrapolation
        y = self.yarn
        interpolation = (np.float32(1.0) / (np.float32(y.factor) * pos_freqs)).astype(np.float32)

        def correction_dim(rotations: float) -> float:
            return (rope_dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta)
            )

        low = max(math.floor(correction_dim(y.beta_fast)), 0)
        high = min(math.ceil(correction_dim(y.beta_slow)), rope_dim - 1)
        if low == high:
            high += 0.001  # the reference avoids a zero-width ramp the same way
        ramp = np.clip((np.arange(rope_dim // 2, dtype=np.float32) - low) / np.float32(high - low), 0, 1)
        extrapolation_factor = (1 - ramp).astype(np.float32)
        return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor).astype(np.float32)


@dataclass(frozen=True)
class Candidates:
    """The first level of a two-level top-k: layer ``source``'s indexer keeps the best ``blocks``
    blocks of ``block_size`` compressed positions, and the index sources from it on pick their
    top-k only inside them."""

    source: int
    block_size: int
    blocks: int


@dataclass(frozen=True)
class LayerSpec:
    """One transformer block as roles, the one description the compiler and runtimes read.

    * ``compress_ratio``: 0, sliding window only; r > 0, r tokens pool into one compressed row
      (1: one row per token).
    * ``kv_source``: the layer whose compressor writes the compressed rows this layer attends
      (and the index keys its indexer scores): itself for a KV source, an earlier layer for one
      that reuses a group's rows, None for a sliding-only layer.
    * ``topk_source``: the layer whose indexer selects the compressed rows this layer attends:
      itself for an index source, an earlier one for a layer that reuses its top-k, None where
      the layer attends every visible compressed row.
    * ``overlap``: the KV source's compressor pools overlapping windows of 2r tokens.
    * ``candidates``: the two-level top-k level this index source produces or selects inside.
    * ``engram``: an Engram n-gram memory feeds the hyper-connection streams before the block.

    V4's kinds are particular values (:func:`v4_layer`): sliding, CSA (own compressor with
    overlapping windows, own indexer) and HCA (own compressor, no indexer); :attr:`attention`
    names the kind back from the roles."""

    index: int
    compress_ratio: int
    moe: str  # HASH_MOE / ROUTED_MOE
    kv_source: int | None = None
    topk_source: int | None = None
    overlap: bool = False
    candidates: Candidates | None = None
    engram: bool = False

    @property
    def is_compressed(self) -> bool:
        return self.compress_ratio > 0

    @property
    def is_kv_source(self) -> bool:
        """Owns a compressor and publishes its group's compressed rows."""
        return self.kv_source == self.index

    @property
    def has_indexer(self) -> bool:
        """Runs an indexer (its own query weights) over its group's index keys."""
        return self.topk_source == self.index

    @property
    def owns_index_keys(self) -> bool:
        """Owns the index compressor whose keys its group's index sources score."""
        return self.is_kv_source and self.has_indexer

    @property
    def indexer_role(self) -> str:
        """none / own_keys / rescore (a source's keys, own weights) / reuse_topk (an earlier layer's top-k)."""
        if self.topk_source is None:
            return "none"
        if not self.has_indexer:
            return "reuse_topk"
        return "own_keys" if self.owns_index_keys else "rescore"

    @property
    def is_candidate_source(self) -> bool:
        return self.candidates is not None and self.candidates.source == self.index

    @property
    def attention(self) -> str:
        """The V4 kind of what attention reads: the window only (SLIDING), every visible
        compressed row (HCA) or a top-k of them (CSA)."""
        if not self.is_compressed:
            return SLIDING
        return HCA if self.topk_source is None else CSA

    @property
    def is_v4(self) -> bool:
        """Whether V4's sliding / CSA / HCA kinds describe this layer (what the trace builds)."""
        return self == v4_layer(self.index, self.attention, self.compress_ratio, self.moe)


def v4_layer(index: int, kind: str, ratio: int, moe: str) -> LayerSpec:
    """A V4 layer of ``kind``: every compressed layer is its own KV source, CSA its own index source."""
    if kind == SLIDING:
        return LayerSpec(index, ratio, moe)
    if kind == HCA:
        return LayerSpec(index, ratio, moe, kv_source=index)
    return LayerSpec(index, ratio, moe, kv_source=index, topk_source=index, overlap=True)


def shared_kv_layers(ratios, moe, kv_sources, index_sources, candidates: Candidates | None,
                     engram) -> tuple[LayerSpec, ...]:
    """The roles of a schedule named by layer ids (V4.1's config fields, checked by the frontend):
    a compressed layer reads the rows of the last KV source at or before it and the top-k of the
    last index source at or before it inside that group; index sources from the candidate source
    on select inside its candidate blocks."""
    layers = []
    for i, (r, m) in enumerate(zip(ratios, moe)):
        if r == 0:
            layers.append(LayerSpec(i, 0, m, engram=i in engram))
            continue
        kv = max(j for j in kv_sources if j <= i)
        topk = max((j for j in index_sources if j <= i), default=None)
        topk = topk if topk is not None and topk >= kv else None
        level = candidates if candidates is not None and topk == i and i >= candidates.source else None
        layers.append(LayerSpec(i, r, m, kv_source=kv, topk_source=topk, candidates=level, engram=i in engram))
    return tuple(layers)


@dataclass(frozen=True)
class WeightFormats:
    """How the checkpoint stores weights (docs/v4.md, "Checkpoint"); the loader also accepts other dtypes."""

    dense: str = "fp8"  # fp8 (fp8_block x fp8_block blocks) / bf16 / fp32
    experts: str = "fp4"  # fp4 (1x32 groups) / fp8 / bf16 / fp32
    scale: str = "e8m0"  # e8m0 / fp32 scales of fp8 blocks
    fp8_block: int = 128  # quantization_config.weight_block_size: 128 (V4), 32 (V4.1's dense weights)


@dataclass(frozen=True)
class Dspark:
    """The DSpark block drafter of 0731 / 0813 checkpoints (docs/v4.md, "DSpark"): its stages
    are the config's ``mtp_layers``; a block of ``block_size`` rows (the anchor, then
    ``noise_token_id``) reads the stages' window rings, which the target step fills from the
    mean hyper-connection streams entering ``target_layers``."""

    block_size: int
    target_layers: tuple[int, ...]
    markov_rank: int
    noise_token_id: int
    n_routed_experts: int  # the stages' (the target's unless the config overrides them)
    n_experts_per_tok: int
    confidence_head: bool = True  # the checkpoint holds confidence_head.proj


# What sets DeepSeek-V4.1's numerics apart from V4's besides its schedule, gate_temp and Engram.
V41_NUMERICS = dict(q_head_norm=False, delayed_mhc=True, activation_fake_quant=True)


@dataclass(frozen=True)
class Engram:
    """The Engram n-gram memory's settings (config fields ``engram_*``, docs/v41.md): the layers
    whose blocks it feeds, the hash's size parameters and each layer's table rows. The hash
    constants derived from the tokenizer are :class:`dsv4c.artifact.engram.EngramTables`."""

    layer_ids: tuple[int, ...]
    vocab_size: int  # the primes are searched above it
    num_embeddings: tuple[int, ...]  # table rows per Engram layer
    max_ngram_size: int
    n_heads: int  # hash heads per n-gram size
    head_dim: int  # table row width
    pad_id: int  # the token that stands for positions before the sequence start
    compressed_vocab_size: int

    # Bytes of one table element as the checkpoint stores it: FP8, one E8M0 scale per 32.
    ELEMENT_BYTES = 1 + 1 / 32

    @property
    def columns(self) -> int:
        """Table rows one token reads per layer: one per (n-gram size, hash head)."""
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def table_bytes(self) -> int:
        """Every table's rows as the checkpoint stores them."""
        return int(sum(self.num_embeddings) * self.head_dim * self.ELEMENT_BYTES)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    main_rope: Rope
    compress_rope: Rope
    layers: tuple[LayerSpec, ...]
    mtp_layers: tuple[LayerSpec, ...] = ()
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = 0
    eos_token_ids: tuple[int, ...] = (1,)
    weights: WeightFormats = field(default_factory=WeightFormats)
    name: str = "custom"
    dspark: Dspark | None = None  # set: mtp_layers are the drafter's stages, not V4's MTP layer
    # DeepSeek-V4.1's numerics (docs/v41.md); the defaults are V4's.
    q_head_norm: bool = True  # V4 normalises each query head; V4.1 does not
    delayed_mhc: bool = False  # V4.1: a site collapses with the previous site's pre, and there is no hc_head
    gate_temp: float = 1.0  # router logits are divided by it
    activation_fake_quant: bool = False  # V4.1's always-on round trips of window KV, compressed KV, index q / k
    engram: Engram | None = None
    # V4.1 with a vision tower: the placeholder token of image spans, whose positions take the
    # tower's rows and route with ``gate.bias_vl`` (docs/vision_text.md); None: text only.
    image_token_id: int | None = None

    @property
    def family(self) -> str:
        """The architecture generation: "v4" or "v4.1" (which names its numerics in messages)."""
        return "v4.1" if self.delayed_mhc else "v4"

    # ----- derived sizes, one place for each -----
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def window_rows_per_request(self) -> int:
        """Sliding-window rows of one request: every backbone layer's and the MTP layers'."""
        return (len(self.layers) + len(self.mtp_layers)) * self.sliding_window

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def hc_mix_size(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult

    def moe_experts(self, layer: LayerSpec) -> tuple[int, int]:
        """(routed experts, experts per token) of a layer: a DSpark stage may have its own."""
        if self.dspark is not None and layer.index >= self.num_layers:
            return self.dspark.n_routed_experts, self.dspark.n_experts_per_tok
        return self.n_routed_experts, self.n_experts_per_tok

    def compress_ratios(self, kind: str) -> tuple[int, ...]:
        return tuple(sorted({l.compress_ratio for l in self.layers + self.mtp_layers if l.attention == kind}))

    # ----- serialisation -----
    def to_json_dict(self, spelling: str | None = None) -> dict[str, Any]:
        """A ``config.json`` that this loader and ``transformers`` both read.

        ``official`` is the hub spelling (``compress_ratios``); ``transformers`` reads it
        only for ratios 0/4/128, so ``hf`` (``layer_types`` + ``compress_rates``) is the
        default for anything else."""
        if self.family == "v4.1":
            return self._v41_json_dict(spelling)
        other = next((l for l in self.layers + self.mtp_layers if not l.is_v4), None)
        if other is not None:
            raise ConfigError(f"layer {other.index}: both config spellings express V4's sliding / CSA / HCA "
                              "layers only, not shared compressed KV, reused top-k or Engram")
        standard = all(l.compress_ratio in (0, 4, 128) for l in self.layers + self.mtp_layers) and all(
            l.compress_ratio == {SLIDING: 0, CSA: 4, HCA: 128}[l.attention] for l in self.layers + self.mtp_layers
        )
        n_hash = self._hash_prefix_length()
        spelling = spelling or ("official" if standard and n_hash is not None else "hf")
        if spelling not in ("official", "hf"):
            raise ConfigError(f"unknown config spelling {spelling!r}; use 'official' or 'hf'")
        if spelling == "official" and not standard:
            raise ConfigError("the official config spelling only expresses compress ratios 0/4/128; use spelling='hf'")
        d: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                             **self._shared_json_fields()}
        yarn = self.compress_rope.yarn
        if spelling == "official":
            d["compress_ratios"] = [l.compress_ratio for l in self.layers + self.mtp_layers]
            if n_hash is None:
                raise ConfigError("num_hash_layers only expresses hash layers as a prefix; use spelling='hf'")
            d["num_hash_layers"] = n_hash
            if yarn:
                d["rope_scaling"] = {
                    "type": "yarn",
                    "factor": yarn.factor,
                    "original_max_position_embeddings": yarn.original_max_position_embeddings,
                    "beta_fast": yarn.beta_fast,
                    "beta_slow": yarn.beta_slow,
                }
        else:
            if any(l.is_compressed for l in self.mtp_layers):
                raise ConfigError(
                    "the hf config spelling has no field for a compressed MTP layer; use spelling='official'"
                )
            inverse = {v: k for k, v in HF_LAYER_TYPES.items()}
            d["layer_types"] = [inverse[l.attention] for l in self.layers]
            d["mlp_layer_types"] = [{HASH_MOE: "hash_moe", ROUTED_MOE: "moe"}[l.moe] for l in self.layers]
            rates = {}
            for kind in (CSA, HCA):
                ratios = self.compress_ratios(kind)
                if len(ratios) > 1:
                    raise ConfigError(f"the hf spelling holds one ratio per attention kind; {kind} layers use {ratios}")
                if ratios:
                    rates[inverse[kind]] = ratios[0]
            d["compress_rates"] = rates
            d.update(self._rope_parameters())
        if self.dspark is not None:
            ds = self.dspark
            d.update({"dspark_block_size": ds.block_size, "dspark_target_layer_ids": list(ds.target_layers),
                      "dspark_markov_rank": ds.markov_rank, "dspark_noise_token_id": ds.noise_token_id,
                      "dspark_n_routed_experts": ds.n_routed_experts,
                      "dspark_num_experts_per_tok": ds.n_experts_per_tok,
                      "dspark_confidence_head": ds.confidence_head})
        d.update(self._format_json_fields())
        return d

    def _rope_parameters(self) -> dict[str, Any]:
        """transformers' ``rope_parameters`` (``main`` / ``compress``) and ``partial_rotary_factor``."""
        yarn = self.compress_rope.yarn
        compress: dict[str, Any] = {"rope_type": "default", "rope_theta": self.compress_rope.theta}
        if yarn:
            compress = {
                "rope_type": "yarn",
                "rope_theta": self.compress_rope.theta,
                "factor": yarn.factor,
                "original_max_position_embeddings": yarn.original_max_position_embeddings,
                "beta_fast": yarn.beta_fast,
                "beta_slow": yarn.beta_slow,
                "attention_factor": 1.0,
            }
        partial = self.rope_dim / self.head_dim
        if int(self.head_dim * partial) != self.rope_dim:  # transformers truncates the product
            partial = math.nextafter(partial, 1.0)
        return {"partial_rotary_factor": partial, "rope_parameters": {
            "main": {"rope_type": "default", "rope_theta": self.main_rope.theta, "partial_rotary_factor": partial},
            "compress": {**compress, "partial_rotary_factor": partial},
        }}

    def _format_json_fields(self) -> dict[str, Any]:
        """How the weights are stored, in both families' spelling."""
        d: dict[str, Any] = {}
        if self.weights.dense == "fp8":
            d["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "scale_fmt": "ue8m0" if self.weights.scale == "e8m0" else None,
                "weight_block_size": [self.weights.fp8_block] * 2,
            }
        # Always written: the loader's default depends on the dense format (fp4 beside fp8).
        d["expert_dtype"] = self.weights.experts
        d["torch_dtype"] = "float32" if self.weights.dense == "fp32" else "bfloat16"
        return d

    def _shared_json_fields(self) -> dict[str, Any]:
        """The fields both families spell the same way."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": 1,
            "num_experts_per_tok": self.n_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_scaling_factor": self.routed_scaling_factor,
            "scoring_func": "sqrtsoftplus",
            "norm_topk_prob": True,
            "swiglu_limit": self.swiglu_limit,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "sliding_window": self.sliding_window,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.main_rope.theta,
            "compress_rope_theta": self.compress_rope.theta,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": len(self.mtp_layers),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "tie_word_embeddings": False,
            "hidden_act": "silu",
        }

    def _v41_json_dict(self, spelling: str | None) -> dict[str, Any]:
        """V4.1's flat transformers spelling (``deepseek_v41_text``, what ``save_pretrained`` writes;
        the frontend also reads the official nesting under ``text_config``)."""
        if spelling not in (None, "official", "hf"):
            raise ConfigError(f"unknown config spelling {spelling!r}; use 'official' or 'hf'")
        layers = self.layers
        candidates = next((l.candidates for l in layers if l.is_candidate_source), None)
        d: dict[str, Any] = {
            "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41_text",
            **self._shared_json_fields(),
            "compress_ratios": [l.compress_ratio for l in layers],
            "kv_source_layer_ids": [l.index for l in layers if l.is_kv_source],
            "index_source_layer_ids": [l.index for l in layers if l.is_compressed and l.has_indexer],
            # A negative id says "no candidate level"; absent would mean the last KV source.
            "candidate_source_layer_id": candidates.source if candidates else -1,
            "gate_temp": self.gate_temp,
            "num_nextn_predict_layers": 0,
        }
        if candidates is not None:
            d.update(candidate_block_size=candidates.block_size, candidate_topk_blocks=candidates.blocks)
        d.update(self._rope_parameters())
        e = self.engram
        d.update(engram_layer_ids=list(e.layer_ids) if e else [], **({
            "engram_vocab_size": e.vocab_size, "engram_num_embeddings": list(e.num_embeddings),
            "engram_max_ngram_size": e.max_ngram_size, "engram_n_heads": e.n_heads, "engram_head_dim": e.head_dim,
            "engram_pad_id": e.pad_id, "engram_compressed_vocab_size": e.compressed_vocab_size} if e else {}))
        if self.image_token_id is not None:
            d["image_token_id"] = self.image_token_id
        d.update(self._format_json_fields())
        if spelling != "official":
            return d
        # The release's nesting: the text model under text_config, the weight formats at the top.
        top = {k: d.pop(k) for k in ("architectures", "quantization_config") if k in d}
        return {**top, "model_type": "deepseek_v41", "text_config": d}

    @staticmethod
    def _v41_layers_from_json(d: dict[str, Any]) -> tuple[LayerSpec, ...]:
        ratios = d["compress_ratios"]
        source = d["candidate_source_layer_id"]
        candidates = Candidates(source, d["candidate_block_size"], d["candidate_topk_blocks"]) if source >= 0 else None
        return shared_kv_layers(ratios, [ROUTED_MOE] * len(ratios), d["kv_source_layer_ids"],
                                d["index_source_layer_ids"], candidates, d["engram_layer_ids"])

    def _hash_prefix_length(self) -> int | None:
        """``num_hash_layers`` of the official spelling; None where hash layers are not a prefix."""
        kinds = [l.moe for l in self.layers]
        n = kinds.count(HASH_MOE)
        return n if kinds == [HASH_MOE] * n + [ROUTED_MOE] * (len(kinds) - n) else None

    def summary(self) -> dict[str, Any]:
        """A JSON-friendly description, stored in artifact manifests."""
        return asdict(self)

    @classmethod
    def from_json_dict(cls, d: dict[str, Any], name: str = "custom", where: str = "manifest.json") -> "ModelConfig":
        """The model :meth:`to_json_dict` wrote in the ``hf`` spelling (an artifact's ``model``).
        A missing or mistyped field is an ArtifactError naming it (a manifest from another writer)."""
        try:
            v41 = d.get("model_type") == "deepseek_v41_text"
            if v41:
                layers, mtp_layers = cls._v41_layers_from_json(d), ()
            else:
                kinds = [HF_LAYER_TYPES[t] for t in d["layer_types"]]
                rates = {HF_LAYER_TYPES[k]: r for k, r in d["compress_rates"].items()}
                moe = [HF_MLP_TYPES[t] for t in d["mlp_layer_types"]]
                n = len(kinds)
                layers = tuple(v4_layer(i, k, rates.get(k, 0), m) for i, (k, m) in enumerate(zip(kinds, moe)))
                mtp_layers = tuple(v4_layer(n + i, SLIDING, 0, ROUTED_MOE)
                                   for i in range(d["num_nextn_predict_layers"]))
            params = d["rope_parameters"]
            compress = params["compress"]
            yarn = None
            if compress["rope_type"] == "yarn":
                yarn = Yarn(compress["factor"], compress["original_max_position_embeddings"], compress["beta_fast"],
                            compress["beta_slow"])
            qc = d.get("quantization_config")
            dense = "fp8" if qc else ("fp32" if d["torch_dtype"] == "float32" else "bf16")
            eos = d["eos_token_id"]
            dspark = None
            if "dspark_block_size" in d:
                dspark = Dspark(d["dspark_block_size"], tuple(d["dspark_target_layer_ids"]), d["dspark_markov_rank"],
                                d["dspark_noise_token_id"], d["dspark_n_routed_experts"],
                                d["dspark_num_experts_per_tok"], d["dspark_confidence_head"])
            cfg = cls(
                vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], num_heads=d["num_attention_heads"],
                head_dim=d["head_dim"], rope_dim=d["qk_rope_head_dim"], q_lora_rank=d["q_lora_rank"],
                o_groups=d["o_groups"], o_lora_rank=d["o_lora_rank"], n_routed_experts=d["n_routed_experts"],
                n_experts_per_tok=d["num_experts_per_tok"], moe_intermediate_size=d["moe_intermediate_size"],
                routed_scaling_factor=d["routed_scaling_factor"], swiglu_limit=d["swiglu_limit"],
                index_n_heads=d["index_n_heads"], index_head_dim=d["index_head_dim"], index_topk=d["index_topk"],
                sliding_window=d["sliding_window"], hc_mult=d["hc_mult"], hc_sinkhorn_iters=d["hc_sinkhorn_iters"],
                hc_eps=d["hc_eps"], rms_norm_eps=d["rms_norm_eps"],
                main_rope=Rope(params["main"]["rope_theta"]), compress_rope=Rope(compress["rope_theta"], yarn),
                layers=layers, mtp_layers=mtp_layers, max_position_embeddings=d["max_position_embeddings"], bos_token_id=d["bos_token_id"],
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
                weights=WeightFormats(dense, d["expert_dtype"],
                                      "e8m0" if (qc or {}).get("scale_fmt", "ue8m0") == "ue8m0" else "fp32",
                                      (qc or {}).get("weight_block_size", [128])[0]),
                name=name, dspark=dspark,
            )
            if not v41:
                return cfg
            e = None
            if d["engram_layer_ids"]:
                e = Engram(tuple(d["engram_layer_ids"]), d["engram_vocab_size"], tuple(d["engram_num_embeddings"]),
                           d["engram_max_ngram_size"], d["engram_n_heads"], d["engram_head_dim"], d["engram_pad_id"],
                           d["engram_compressed_vocab_size"])
            return replace(cfg, **V41_NUMERICS, gate_temp=d["gate_temp"], engram=e,
                           image_token_id=d.get("image_token_id"))
        except (KeyError, TypeError, AttributeError) as e:
            raise ArtifactError(f"{where}: the model description lacks or mangles field {e}; write it again "
                                "with this dsv4c (recompile / re-export)") from None
