"""The tensor inventory: which tensors a V4 checkpoint of a config holds, their logical shapes
and their storage kind, in one stable order. The reader checks a checkpoint against it, the
writer lays one out from it, the random-model generator fills it (docs/v4.md, "Checkpoint")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from dsv4c.artifact.engram_tables import table_weight
from dsv4c.artifact.model_config import CSA, HASH_MOE, LayerSpec, ModelConfig

# How a checkpoint stores a tensor (docs/v4.md, "Checkpoint").
DENSE = "dense"  # FP8 e4m3 with block scales (128x128 in V4's checkpoints)
EXPERT = "expert"  # FP4 e2m1 packed, 1x32 E8M0 scales
BF16 = "bf16"  # compressors, weights_proj, gate, embed, head
FP32 = "fp32"  # mHC, sinks, router bias, norms, ape
INDEX = "index"  # tid2eid
TABLE = "table"  # V4.1's Engram rows: FP8 e4m3 with one E8M0 scale per 32 columns of each row


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str


def _block_tensors(cfg: ModelConfig, layer: LayerSpec, p: str) -> Iterator[TensorSpec]:
    d, n, q, h, dh = cfg.hidden_size, cfg.hc_mult, cfg.q_lora_rank, cfg.num_heads, cfg.head_dim
    g, r, inter = cfg.o_groups, cfg.o_lora_rank, cfg.moe_intermediate_size
    e = cfg.moe_experts(layer)[0]
    yield TensorSpec(f"{p}attn_norm.weight", (d,), FP32)
    yield TensorSpec(f"{p}ffn_norm.weight", (d,), FP32)
    for which in ("attn", "ffn"):
        yield TensorSpec(f"{p}hc_{which}_fn", (cfg.hc_mix_size, n * d), FP32)
        yield TensorSpec(f"{p}hc_{which}_base", (cfg.hc_mix_size,), FP32)
        yield TensorSpec(f"{p}hc_{which}_scale", (3,), FP32)
    a = f"{p}attn."
    yield TensorSpec(f"{a}wq_a.weight", (q, d), DENSE)
    yield TensorSpec(f"{a}q_norm.weight", (q,), FP32)
    yield TensorSpec(f"{a}wq_b.weight", (h * dh, q), DENSE)
    yield TensorSpec(f"{a}wkv.weight", (dh, d), DENSE)
    yield TensorSpec(f"{a}kv_norm.weight", (dh,), FP32)
    yield TensorSpec(f"{a}wo_a.weight", (g * r, h * dh // g), DENSE)
    yield TensorSpec(f"{a}wo_b.weight", (d, g * r), DENSE)
    yield TensorSpec(f"{a}attn_sink", (h,), FP32)
    if cfg.family == "v4.1":
        yield from _v41_attention_extras(cfg, layer, a)
    else:
        if layer.is_compressed:
            width = (2 if layer.attention == CSA else 1) * dh
            yield from _compressor(f"{a}compressor.", d, width, dh, layer.compress_ratio)
        if layer.has_indexer:
            yield from _indexer_queries(cfg, a)
            yield from _compressor(f"{a}indexer.compressor.", d, 2 * cfg.index_head_dim, cfg.index_head_dim,
                                   layer.compress_ratio)
    f = f"{p}ffn."
    yield TensorSpec(f"{f}gate.weight", (e, d), BF16)
    if layer.moe == HASH_MOE:
        yield TensorSpec(f"{f}gate.tid2eid", (cfg.vocab_size, cfg.n_experts_per_tok), INDEX)
    else:
        yield TensorSpec(f"{f}gate.bias", (e,), FP32)
    if cfg.family == "v4.1":  # the router bias of image-span tokens (read where the model takes images)
        yield TensorSpec(f"{f}gate.bias_vl", (e,), FP32)
    for i in range(e):
        yield from _ffn(f"{f}experts.{i}.", d, inter, EXPERT)
    yield from _ffn(f"{f}shared_experts.", d, inter, DENSE)


def _indexer_queries(cfg: ModelConfig, a: str) -> Iterator[TensorSpec]:
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    yield TensorSpec(f"{a}indexer.wq_b.weight", (hi * di, cfg.q_lora_rank), DENSE)
    yield TensorSpec(f"{a}indexer.weights_proj.weight", (hi, cfg.hidden_size), BF16)


def _v41_attention_extras(cfg: ModelConfig, layer: LayerSpec, a: str) -> Iterator[TensorSpec]:
    """A V4.1 KV source's compressor (no ``ape``, no overlap; ratio 1 has no gate), an index
    source's queries, and the index-key projection of a KV source that is one."""
    d, dh = cfg.hidden_size, cfg.head_dim
    if layer.is_kv_source:
        yield TensorSpec(f"{a}compressor.wkv.weight", (dh, d), BF16)
        if layer.compress_ratio > 1:
            yield TensorSpec(f"{a}compressor.wgate.weight", (dh, d), BF16)
        yield TensorSpec(f"{a}compressor.norm.weight", (dh,), FP32)
    if layer.is_compressed and layer.has_indexer:
        yield from _indexer_queries(cfg, a)
    if layer.owns_index_keys:
        yield TensorSpec(f"{a}indexer.wk.weight", (cfg.index_head_dim, dh), DENSE)
        yield TensorSpec(f"{a}indexer.k_norm.weight", (cfg.index_head_dim,), FP32)


def _engram(cfg: ModelConfig, ordinal: int, p: str) -> Iterator[TensorSpec]:
    e, d, n = cfg.engram, cfg.hidden_size, cfg.hc_mult
    yield TensorSpec(table_weight(e.layer_ids[ordinal]), (e.num_embeddings[ordinal], e.head_dim), TABLE)
    yield TensorSpec(f"{p}engram.wkv.weight", ((n + 1) * d, e.columns * e.head_dim), DENSE)
    yield TensorSpec(f"{p}engram.q_weight", (n, d), FP32)
    yield TensorSpec(f"{p}engram.k_weight", (n, d), FP32)


def _compressor(p: str, d: int, width: int, head_dim: int, ratio: int) -> Iterator[TensorSpec]:
    yield TensorSpec(f"{p}wkv.weight", (width, d), BF16)
    yield TensorSpec(f"{p}wgate.weight", (width, d), BF16)
    yield TensorSpec(f"{p}ape", (ratio, width), FP32)
    yield TensorSpec(f"{p}norm.weight", (head_dim,), FP32)


def _ffn(p: str, d: int, inter: int, kind: str) -> Iterator[TensorSpec]:
    yield TensorSpec(f"{p}w1.weight", (inter, d), kind)
    yield TensorSpec(f"{p}w2.weight", (d, inter), kind)
    yield TensorSpec(f"{p}w3.weight", (inter, d), kind)


def inventory(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the official checkpoint of ``cfg``, in a stable order."""
    d, n = cfg.hidden_size, cfg.hc_mult
    out = [TensorSpec("embed.weight", (cfg.vocab_size, d), BF16), TensorSpec("head.weight", (cfg.vocab_size, d), BF16),
           TensorSpec("norm.weight", (d,), FP32)]
    if not cfg.delayed_mhc:  # V4.1 collapses the streams with the last site's pre instead
        out += [TensorSpec("hc_head_fn", (n, n * d), FP32), TensorSpec("hc_head_base", (n,), FP32),
                TensorSpec("hc_head_scale", (1,), FP32)]
    engram = cfg.engram.layer_ids if cfg.engram else ()
    for layer in cfg.layers:
        p = f"layers.{layer.index}."
        if layer.engram:
            out += _engram(cfg, engram.index(layer.index), p)
        out += _block_tensors(cfg, layer, p)
    if cfg.dspark is not None:
        return out + dspark_inventory(cfg)
    for i, layer in enumerate(cfg.mtp_layers):
        p = f"mtp.{i}."
        out += [TensorSpec(f"{p}e_proj.weight", (d, d), DENSE), TensorSpec(f"{p}h_proj.weight", (d, d), DENSE),
                TensorSpec(f"{p}enorm.weight", (d,), FP32), TensorSpec(f"{p}hnorm.weight", (d,), FP32),
                TensorSpec(f"{p}norm.weight", (d,), FP32), TensorSpec(f"{p}hc_head_fn", (n, n * d), FP32),
                TensorSpec(f"{p}hc_head_base", (n,), FP32), TensorSpec(f"{p}hc_head_scale", (1,), FP32)]
        out += _block_tensors(cfg, layer, p)
    return out


def dspark_inventory(cfg: ModelConfig) -> list[TensorSpec]:
    """The DSpark drafter's tensors: a sliding block per stage, ``main_proj`` / ``main_norm`` on the
    first stage, the final norm, hc head, Markov head and (optional) confidence head on the last.
    The drafter shares the target's embedding and head."""
    d, n, v = cfg.hidden_size, cfg.hc_mult, cfg.vocab_size
    ds, last = cfg.dspark, len(cfg.mtp_layers) - 1
    out: list[TensorSpec] = []
    for s, layer in enumerate(cfg.mtp_layers):
        p = f"mtp.{s}."
        if s == 0:
            out += [TensorSpec(f"{p}main_proj.weight", (d, len(ds.target_layers) * d), DENSE),
                    TensorSpec(f"{p}main_norm.weight", (d,), FP32)]
        if s == last:
            out += [TensorSpec(f"{p}norm.weight", (d,), FP32), TensorSpec(f"{p}hc_head_fn", (n, n * d), FP32),
                    TensorSpec(f"{p}hc_head_base", (n,), FP32), TensorSpec(f"{p}hc_head_scale", (1,), FP32),
                    TensorSpec(f"{p}markov_head.markov_w1.weight", (v, ds.markov_rank), BF16),
                    TensorSpec(f"{p}markov_head.markov_w2.weight", (v, ds.markov_rank), BF16)]
            if ds.confidence_head:
                out.append(TensorSpec(f"{p}confidence_head.proj.weight", (1, d + ds.markov_rank), BF16))
        out += _block_tensors(cfg, layer, p)
    return out


def scale_name(name: str) -> str:
    """The name of the scale tensor of a quantized tensor ``name``."""
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"
