"""Checkpoints: the tensor inventory of a config, a streaming loader, and a quantizing writer.

The inventory (:func:`inventory`) is the one place that says which tensors a V4 checkpoint
holds, their logical shapes and their storage kind (SPEC §3). The reader takes official
names and ``transformers`` names, checks every tensor from the shard headers, and then hands
out row ranges in the checkpoint's own storage (:class:`Rows`: FP8 / FP4 codes with their
scales, BF16 bits), or dequantized to fp32 for models that fit in memory. The writer produces
the official format with the same scale rules (E8M0 power-of-two scales) from a stream of row
pieces, atomically.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np

from dsv4c.artifact import lowbit
from dsv4c.artifact.model_config import CSA, HASH_MOE, LayerSpec, ModelConfig
from dsv4c.artifact.quant import FP8_BLOCK_SIZES
from dsv4c.artifact.rows import ConcatRows, Rows, RowSource
from dsv4c.artifact.safetensors_io import STORAGE_DTYPES, SafetensorsFile, SafetensorsWriter
from dsv4c.errors import CheckpointError, UsageError
from dsv4c.threads import BoundedPool

# Storage kinds of SPEC §3.
DENSE = "dense"  # FP8 e4m3 with block scales (128x128 in V4's checkpoints)
EXPERT = "expert"  # FP4 e2m1 packed, 1x32 E8M0 scales
BF16 = "bf16"  # compressors, weights_proj, gate, embed, head
FP32 = "fp32"  # mHC, sinks, router bias, norms, ape
INDEX = "index"  # tid2eid

_EXPERT_IR = re.compile(r"^(?P<prefix>.*\.ffn\.experts)\.(?P<w>w[123])$")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    kind: str


def _block_tensors(cfg: ModelConfig, layer: LayerSpec, p: str) -> Iterator[TensorSpec]:
    d, n, q, h, dh = cfg.hidden_size, cfg.hc_mult, cfg.q_lora_rank, cfg.num_heads, cfg.head_dim
    g, r, e, inter = cfg.o_groups, cfg.o_lora_rank, cfg.n_routed_experts, cfg.moe_intermediate_size
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
    if layer.is_compressed:
        width = (2 if layer.attention == CSA else 1) * dh
        yield from _compressor(f"{a}compressor.", d, width, dh, layer.compress_ratio)
    if layer.has_indexer:
        hi, di = cfg.index_n_heads, cfg.index_head_dim
        yield TensorSpec(f"{a}indexer.wq_b.weight", (hi * di, q), DENSE)
        yield TensorSpec(f"{a}indexer.weights_proj.weight", (hi, d), BF16)
        yield from _compressor(f"{a}indexer.compressor.", d, 2 * di, di, layer.compress_ratio)
    f = f"{p}ffn."
    yield TensorSpec(f"{f}gate.weight", (e, d), BF16)
    if layer.moe == HASH_MOE:
        yield TensorSpec(f"{f}gate.tid2eid", (cfg.vocab_size, cfg.n_experts_per_tok), INDEX)
    else:
        yield TensorSpec(f"{f}gate.bias", (e,), FP32)
    for i in range(e):
        yield from _ffn(f"{f}experts.{i}.", d, inter, EXPERT)
    yield from _ffn(f"{f}shared_experts.", d, inter, DENSE)


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
           TensorSpec("norm.weight", (d,), FP32), TensorSpec("hc_head_fn", (n, n * d), FP32),
           TensorSpec("hc_head_base", (n,), FP32), TensorSpec("hc_head_scale", (1,), FP32)]
    for layer in cfg.layers:
        out += _block_tensors(cfg, layer, f"layers.{layer.index}.")
    for i, layer in enumerate(cfg.mtp_layers):
        p = f"mtp.{i}."
        out += [TensorSpec(f"{p}e_proj.weight", (d, d), DENSE), TensorSpec(f"{p}h_proj.weight", (d, d), DENSE),
                TensorSpec(f"{p}enorm.weight", (d,), FP32), TensorSpec(f"{p}hnorm.weight", (d,), FP32),
                TensorSpec(f"{p}norm.weight", (d,), FP32), TensorSpec(f"{p}hc_head_fn", (n, n * d), FP32),
                TensorSpec(f"{p}hc_head_base", (n,), FP32), TensorSpec(f"{p}hc_head_scale", (1,), FP32)]
        out += _block_tensors(cfg, layer, p)
    return out


# --------------------------------------------------------------------------- names

# transformers' names (conversion_mapping.py, "deepseek_v4") back to the official ones.
_HF_TO_OFFICIAL = [
    (r"^model\.", ""),
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.self_attn\.sinks$", ".self_attn.attn_sink"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.self_attn\.", ".attn."),
    # save_pretrained reverses the mapping and its norm -> kv_norm rule also hits the
    # attention's own kv_norm (transformers 5.23 writes ``model.layers.N.attn.norm.weight``).
    (r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"),
    (r"\.mlp\.", ".ffn."),
    (r"\.weight_scale_inv$", ".scale"),
]
_HF_RULES = [(re.compile(a), b) for a, b in _HF_TO_OFFICIAL]
_HF_MERGED_EXPERTS = re.compile(r"^(?P<prefix>.*\.ffn\.experts)\.(?P<which>gate_up_proj|down_proj)$")


def official_name(name: str) -> str:
    """Map a ``transformers`` tensor name to the official one (official names pass through)."""
    for pattern, repl in _HF_RULES:
        name = pattern.sub(repl, name)
    return name


# --------------------------------------------------------------------------- reading


def _scale_name(name: str) -> str:
    return name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"


FLOAT_STORAGE = ("F32", "F16", "BF16")


class TensorRows(RowSource):
    """One stored checkpoint tensor (with its scale tensor when quantized), checked by
    :meth:`Checkpoint.source` from the headers alone; ``row_offset`` places a per-expert slice
    of a merged transformers expert tensor."""

    def __init__(self, where: str, st: SafetensorsFile, stored: str, storage: str, shape: tuple[int, ...],
                 scale: tuple | None = None, row_offset: int = 0,
                 n_experts: int | None = None):
        self.where, self.st, self.stored, self.storage, self.shape = where, st, stored, storage, shape
        self.scale, self.row_offset, self.n_experts = scale, row_offset, n_experts

    def read(self, start: int, stop: int) -> list[Rows]:
        values = self.st.read_rows(self.stored, self.row_offset + start, self.row_offset + stop)
        scales = None
        if self.storage == "INT":
            values = values.astype(np.int64)
            if self.n_experts is not None and ((values < 0) | (values >= self.n_experts)).any():
                raise CheckpointError(f"{self.where} holds expert ids outside [0, {self.n_experts})")
        elif self.storage == "FP8":
            sst, sname, fmt, block = self.scale
            first = start // block
            grid = sst.read_rows(sname, first, -(-stop // block))
            grid = lowbit.decode_e8m0(grid) if fmt == "e8m0" else grid.astype(np.float32)
            scales = grid[np.arange(start, stop) // block - first]
            return [Rows(self.storage, values, scales, block)]
        elif self.storage == "FP4":
            values = values.view(np.uint8)
            sst, sname, _ = self.scale
            scales = sst.read_rows(sname, start, stop)
        return [Rows(self.storage, values, scales)]


class Checkpoint:
    """A single ``.safetensors`` file or a directory of shards, read tensor by tensor."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        files = self._shard_files()
        self._files: dict[Path, SafetensorsFile] = {}
        self._where: dict[str, tuple[Path, str]] = {}  # official name -> (file, stored name)
        self._merged: dict[str, tuple[Path, str, int]] = {}  # virtual per-expert name -> merged tensor
        try:
            for f in files:
                st = self._open(f)
                for stored in st.names():
                    self._add(official_name(stored), f, stored)
        except BaseException:
            self.close()
            raise

    def _shard_files(self) -> list[Path]:
        p = self.path
        index = p / "model.safetensors.index.json"
        if p.is_file() and p.name.endswith(".index.json"):
            p, index = p.parent, p
        elif p.is_file():
            return [p]
        elif not p.is_dir():
            raise CheckpointError(f"{p}: no such checkpoint file or directory")
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted({p / v for v in weight_map.values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e.__class__.__name__})") from None
            missing = [f for f in files if not f.is_file()]
            if missing:
                raise CheckpointError(f"{index}: lists shard {missing[0].name}, which is missing from {p}")
            return files
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{p}: no .safetensors files in this directory")
        return files

    def _open(self, f: Path) -> SafetensorsFile:
        if f not in self._files:
            self._files[f] = SafetensorsFile(f)
        return self._files[f]

    def _add(self, name: str, f: Path, stored: str) -> None:
        m = _HF_MERGED_EXPERTS.match(name)
        if not m:
            self._claim(name, f)
            self._where[name] = (f, stored)
            return
        shape = self._open(f).shape(stored)
        if len(shape) != 3:
            raise CheckpointError(f"{f.name}: merged expert tensor {stored} has shape {list(shape)}; expected 3-D")
        for e in range(shape[0]):
            parts = ("w1", "w3") if m["which"] == "gate_up_proj" else ("w2",)
            for half, w in enumerate(parts):
                virtual = f"{m['prefix']}.{e}.{w}.weight"
                self._claim(virtual, f)
                self._merged[virtual] = (f, stored, e * 2 + half)

    def _claim(self, name: str, f: Path) -> None:
        held = self._where.get(name, self._merged.get(name))
        if held is not None:
            raise CheckpointError(f"{self.path}: tensor {name} is stored twice ({held[0].name}, {f.name})")

    def names(self) -> list[str]:
        return sorted(set(self._where) | set(self._merged))

    def __contains__(self, name: str) -> bool:
        return name in self._where or name in self._merged

    def close(self) -> None:
        for st in self._files.values():
            st.close()
        self._files.clear()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, spec: TensorSpec, n_experts: int | None = None) -> np.ndarray:
        """The tensor of ``spec`` as fp32 (int64 for tid2eid), checked against its spec;
        expert ids in tid2eid must lie in ``[0, n_experts)``."""
        return self.source(spec, n_experts).read_all()

    def source(self, spec: TensorSpec, n_experts: int | None = None) -> TensorRows:
        """The tensor of ``spec`` as a row source, its dtype, shape and scales checked against
        the spec from the headers alone (SPEC §3 storage kinds); expert ids in tid2eid are
        checked against ``[0, n_experts)`` as they are read."""
        if spec.name in self._merged:
            return self._merged_source(spec)
        if spec.name not in self._where:
            raise CheckpointError(f"{self.path}: missing tensor {spec.name} (expected shape {list(spec.shape)})")
        f, stored = self._where[spec.name]
        st = self._open(f)
        dtype, shape = st.dtype(stored), tuple(st.shape(stored))
        where = f"{f.name}: tensor {spec.name}"
        scale, logical = None, shape
        if spec.kind == INDEX:
            if dtype not in ("I64", "I32"):
                raise CheckpointError(f"{where} has dtype {dtype}; expected I64 or I32")
            storage = "INT"
        elif dtype in FLOAT_STORAGE:
            storage = dtype
        elif dtype == "F8_E4M3" and spec.kind in (DENSE, EXPERT):
            storage, scale = "FP8", self._fp8_scale(spec.name, shape, where)
        elif dtype in ("I8", "U8") and spec.kind == EXPERT:
            storage, scale = "FP4", self._fp4_scale(spec.name, shape, where)
            logical = (shape[0], 2 * shape[1])
        else:
            raise CheckpointError(f"{where} has dtype {dtype}, which is not a valid storage for a {spec.kind} tensor")
        if logical != spec.shape:
            raise CheckpointError(f"{where} has shape {list(logical)}; the config implies {list(spec.shape)}")
        return TensorRows(where, st, stored, storage, spec.shape, scale, n_experts=n_experts)

    def _companion_scale(self, name: str, where: str) -> tuple[SafetensorsFile, str, str]:
        official = _scale_name(name)
        if official not in self._where:
            raise CheckpointError(f"{where} is quantized but its scale tensor {official} is missing")
        f, stored = self._where[official]
        st = self._open(f)
        return st, stored, st.dtype(stored)

    def _fp8_scale(self, name: str, shape: tuple[int, ...], where: str) -> tuple[SafetensorsFile, str, str, int]:
        """The scale tensor of an FP8 tensor, its format and its block size, which its shape tells
        (blocks of every size agree on a tensor of one block)."""
        sst, sname, sdtype = self._companion_scale(name, where)
        if len(shape) != 2:
            raise CheckpointError(f"{where}: FP8 tensors must be 2-D, got {list(shape)}")
        grids = {b: [-(-shape[0] // b), -(-shape[1] // b)] for b in FP8_BLOCK_SIZES}
        block = next((b for b, grid in grids.items() if grid == list(sst.shape(sname))), None)
        if block is None:
            raise CheckpointError(f"{where}: scale has shape {list(sst.shape(sname))}; FP8 blocks of "
                                  + " or ".join(f"{b}x{b} need {grid}" for b, grid in grids.items()))
        fmt = {"F8_E8M0": "e8m0", "F32": "fp32", "U8": "e8m0"}.get(sdtype)
        if fmt is None:
            raise CheckpointError(f"{where}: scale dtype {sdtype} is neither E8M0 nor F32")
        return sst, sname, fmt, block

    def _fp4_scale(self, name: str, shape: tuple[int, ...], where: str) -> tuple[SafetensorsFile, str, str]:
        sst, sname, sdtype = self._companion_scale(name, where)
        if len(shape) != 2 or (2 * shape[1]) % 32:
            raise CheckpointError(f"{where}: packed FP4 tensors must be 2-D with 16k columns, got {list(shape)}")
        want = (shape[0], 2 * shape[1] // 32)
        if sdtype not in ("F8_E8M0", "U8") or tuple(sst.shape(sname)) != want:
            raise CheckpointError(f"{where}: FP4 scale must be E8M0 of shape {list(want)}")
        return sst, sname, "e8m0"

    def _merged_source(self, spec: TensorSpec) -> TensorRows:
        f, stored, slot = self._merged[spec.name]
        st = self._open(f)
        dtype = st.dtype(stored)
        if dtype not in FLOAT_STORAGE:
            raise CheckpointError(f"{f.name}: merged expert tensor {stored} must be a float tensor")
        experts, rows, cols = st.shape(stored)  # [E, 2I, D] (gate_up) or [E, D, I] (down)
        e, half = divmod(slot, 2)
        if stored.endswith("gate_up_proj"):
            rows //= 2
        if (rows, cols) != spec.shape:
            raise CheckpointError(f"{f.name}: {spec.name} (from {stored}) has shape {[rows, cols]}; "
                                  f"the config implies {list(spec.shape)}")
        per_expert = st.shape(stored)[1]
        return TensorRows(f"{f.name}: tensor {spec.name}", st, stored, dtype, spec.shape,
                          row_offset=e * per_expert + half * rows)


def ir_sources(cfg: ModelConfig, ckpt: Checkpoint, names: set[str] | None = None) -> dict[str, RowSource]:
    """The IR weights (every one, or those in ``names``) as row sources over ``ckpt``: routed
    experts stacked into ``<layer>.ffn.experts.w{1,2,3}`` of shape ``[E, out, in]``. Every
    tensor's storage and shape is checked here, before any data is read."""
    groups: dict[str, list[TensorSpec]] = {}
    for spec in inventory(cfg):  # the inventory lists experts in order
        ir = _ir_name(spec.name)
        if names is None or ir in names:
            groups.setdefault(ir, []).append(spec)
    out: dict[str, RowSource] = {}
    for ir, specs in groups.items():
        parts = [ckpt.source(s, cfg.n_routed_experts) for s in specs]
        out[ir] = parts[0] if ir == specs[0].name else ConcatRows(parts, (len(parts), *specs[0].shape))
    return out


def load_weights(cfg: ModelConfig, path: str | os.PathLike, names: set[str] | None = None,
                 progress: bool = False) -> dict[str, np.ndarray]:
    """Read every tensor of the inventory (or those in ``names``) into memory as the IR's
    weights (see :func:`ir_sources`), dequantized to fp32. For models that fit in memory
    (tests, ONNX export); ``dsv4c compile`` streams instead."""
    every = inventory(cfg)
    if names is not None:
        unknown = sorted(set(names) - {_ir_name(s.name) for s in every})
        if unknown:
            raise UsageError(f"load_weights: {unknown[0]} is not a weight of this model ({len(unknown)} unknown names)")
    with Checkpoint(path) as ckpt:
        if names is None:
            # A checkpoint of a deeper or wider model (more layers, experts, an MTP block)
            # would otherwise load as a truncated one without a word.
            known = {s.name for s in every} | {_scale_name(s.name) for s in every if s.kind in (DENSE, EXPERT)}
            extra = [n for n in ckpt.names() if n not in known]
            if extra:
                raise CheckpointError(f"{ckpt.path}: holds {len(extra)} tensors the config does not describe, e.g. "
                                      f"{extra[0]}; the checkpoint does not match the model configuration")
        sources = ir_sources(cfg, ckpt, names)
        items = sources.items()
        if progress:
            from tqdm import tqdm

            items = tqdm(items, desc="loading weights", unit="tensor", leave=False)
        return {name: source.read_all() for name, source in items}


def _ir_name(official: str) -> str:
    """``layers.3.ffn.experts.5.w1.weight`` -> ``layers.3.ffn.experts.w1``; others unchanged."""
    m = re.match(r"^(.*\.ffn\.experts)\.\d+\.(w[123])\.weight$", official)
    return f"{m[1]}.{m[2]}" if m else official


# --------------------------------------------------------------------------- writing

# Rows generated, quantized and written at a time: float64 bytes of random values (a 128-row
# multiple, so FP8 blocks, 128 or 32 rows, never straddle two pieces). The writers hold a few
# pieces at once, and quantizing one takes about ten times its float32 size in int64 temporaries.
PIECE_BYTES = 8 << 20


def _row_pieces(shape: tuple[int, ...], itemsize: int = 8) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges along the first axis of a tensor, about PIECE_BYTES each."""
    row_bytes = max(math.prod(shape[1:]) * itemsize, 1)
    step = max(128, PIECE_BYTES // row_bytes // 128 * 128)
    return [(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]


def _storage(spec: TensorSpec, cfg: ModelConfig) -> str:
    """How the checkpoint of ``cfg`` stores ``spec``: index, fp8, fp4, bf16 or fp32."""
    fmt = cfg.weights
    if spec.kind == INDEX:
        return "index"
    return {DENSE: fmt.dense, EXPERT: fmt.experts, BF16: "fp32" if fmt.dense == "fp32" else "bf16",
            FP32: "fp32"}[spec.kind]


def _stored_entries(spec: TensorSpec, cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The stored tensors (value and, when quantized, its scale) of one logical tensor: dtype and shape."""
    storage, shape = _storage(spec, cfg), spec.shape
    if storage == "fp8":
        block = cfg.weights.fp8_block
        grid = (-(-shape[0] // block), -(-shape[1] // block))
        return {spec.name: ("F8_E4M3", shape),
                _scale_name(spec.name): ("F8_E8M0" if cfg.weights.scale == "e8m0" else "F32", grid)}
    if storage == "fp4":
        return {spec.name: ("I8", (shape[0], shape[1] // 2)), _scale_name(spec.name): ("F8_E8M0", (shape[0], shape[1] // 32))}
    return {spec.name: ({"index": "I64", "bf16": "BF16"}.get(storage, "F32"), shape)}


def _encode(spec: TensorSpec, rows: np.ndarray, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The stored bytes of rows of one logical tensor (FP8 pieces start on a row block)."""
    storage = _storage(spec, cfg)
    if storage == "index":
        return {spec.name: rows.astype(np.int64)}
    rows = np.asarray(rows, np.float32)
    if storage == "fp8":
        codes, scales = lowbit.quantize_fp8_blocks(rows, cfg.weights.fp8_block, cfg.weights.scale)
        return {spec.name: codes, _scale_name(spec.name): scales}
    if storage == "fp4":
        packed, scales = lowbit.quantize_fp4_groups(rows, 32)
        return {spec.name: packed, _scale_name(spec.name): scales}
    if storage == "bf16":
        return {spec.name: lowbit.bf16_bits_from_f32(rows)}
    return {spec.name: rows}


def _write_piece(writer: SafetensorsWriter, spec: TensorSpec, start: int, rows: np.ndarray, cfg: ModelConfig) -> int:
    """Encode rows ``start ...`` of ``spec`` and write them where they belong; the bytes written."""
    written = 0
    for name, array in _encode(spec, rows, cfg).items():
        fp8_scales = _storage(spec, cfg) == "fp8" and name != spec.name
        first = start // cfg.weights.fp8_block if fp8_scales else start  # block-scale rows
        row_bytes = array.nbytes // array.shape[0] if array.shape[0] else 0
        writer.write(name, array, first * row_bytes)
        written += array.nbytes
    return written


def _mapping_pieces(specs: list[TensorSpec], weights: Mapping[str, np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """Whole tensors as a stream of pieces; names are checked now, shapes as each is read."""
    extra = sorted(set(weights) - {s.name for s in specs})
    if extra:
        raise CheckpointError(f"cannot write checkpoint: tensor {extra[0]} is not in the model's inventory "
                              f"({len(extra)} such tensors; official names, one tensor per expert)")
    missing = [s.name for s in specs if s.name not in weights]
    if missing:
        raise CheckpointError(f"cannot write checkpoint: tensor {missing[0]} was not provided")

    def pieces() -> Iterator[tuple[str, np.ndarray]]:
        for spec in specs:
            value = np.asarray(weights[spec.name])  # once: a mapping may load its values lazily
            if value.shape != spec.shape:
                raise CheckpointError(f"cannot write checkpoint: tensor {spec.name} has shape "
                                      f"{list(value.shape)}; the config implies {list(spec.shape)}")
            for start, stop in _row_pieces(spec.shape, value.itemsize):
                yield spec.name, value[start:stop]

    return pieces()


def _checked_pieces(specs: list[TensorSpec], pieces: Iterable[tuple[str, np.ndarray]],
                    cfg: ModelConfig) -> Iterator[tuple[TensorSpec, int, np.ndarray]]:
    """(spec, first row, rows) of each piece of a stream, checked: inventory order, every
    tensor complete, nothing else."""
    known = {s.name for s in specs}
    stream = iter(pieces)
    for spec in specs:
        done = 0
        while done < spec.shape[0]:
            name, rows = next(stream, (None, None))
            if name != spec.name:
                if name is not None and name not in known:
                    raise CheckpointError(f"cannot write checkpoint: tensor {name} is not in the model's inventory "
                                          "(official names, one tensor per expert)")
                if done == 0:
                    raise CheckpointError(f"cannot write checkpoint: tensor {spec.name} was not provided")
                raise CheckpointError(f"cannot write checkpoint: tensor {spec.name} ended after {done} of "
                                      f"{spec.shape[0]} rows")
            rows = np.asarray(rows)
            if rows.shape[1:] != spec.shape[1:] or done + len(rows) > spec.shape[0]:
                raise CheckpointError(f"cannot write checkpoint: a piece of tensor {spec.name} has shape "
                                      f"{list(rows.shape)} at row {done}; the config implies {list(spec.shape)}")
            if done % cfg.weights.fp8_block and _storage(spec, cfg) == "fp8":
                raise ValueError(f"pieces of FP8 tensor {spec.name} must start on a {cfg.weights.fp8_block}-row "
                                 f"block (row {done})")
            yield spec, done, rows
            done += len(rows)
    leftover = next(stream, None)
    if leftover is not None:
        raise CheckpointError(f"cannot write checkpoint: tensor {leftover[0]} comes after the whole inventory "
                              "(stored twice, or not in the model)")


def write_checkpoint(cfg: ModelConfig, weights: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
                     out_dir: str | os.PathLike, shard_bytes: int = 2 << 30, spelling: str | None = None,
                     progress: bool = False) -> Path:
    """Write ``config.json`` + official-format shards (official names, fp32 values in).

    ``weights`` maps names to whole tensors, or is a stream of ``(name, rows)`` pieces in
    inventory order, a tensor's pieces one after another along its first axis (FP8 tensors in
    128-row multiples): :func:`iter_random_weights` streams a model that never sits in memory
    whole. The shards are laid out up front; a few threads quantize and write each piece while
    the next is made. Written into a temporary directory next to ``out_dir`` and renamed at the
    end: an interrupted write leaves nothing at ``out_dir``."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: exists and is not an empty directory; choose a new directory")
    specs = inventory(cfg)
    if isinstance(weights, Mapping):
        weights = _mapping_pieces(specs, weights)
    entries = {spec.name: _stored_entries(spec, cfg) for spec in specs}
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = sum(math.prod(shape) * STORAGE_DTYPES[dtype].itemsize for dtype, shape in entries[spec.name].values())
        if size and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    writers: list[SafetensorsWriter] = []
    try:
        weight_map, writer_of = {}, {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            stored = {name: entry for spec in shard for name, entry in entries[spec.name].items()}
            writers.append(SafetensorsWriter(tmp / fname, stored, {"format": "pt"}))
            weight_map.update({name: fname for name in stored})
            writer_of.update({spec.name: writers[-1] for spec in shard})
        total = sum(math.prod(shape) * STORAGE_DTYPES[dtype].itemsize for e in entries.values() for dtype, shape in e.values())
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="writing checkpoint", unit="B", unit_scale=True, unit_divisor=1024, leave=False)
        with BoundedPool(on_result=bar.update if bar is not None else None) as pool:
            for spec, start, rows in _checked_pieces(specs, weights, cfg):
                pool.submit(_write_piece, writer_of[spec.name], spec, start, rows, cfg)
        if bar is not None:
            bar.close()
        for writer in writers:
            writer.finish()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(cfg.to_json_dict(spelling), indent=2))
        if out.exists():
            out.rmdir()
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; a model directory is not
        os.replace(tmp, out)
    except BaseException:
        for writer in writers:
            writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def iter_random_weights(cfg: ModelConfig, seed: int = 0) -> Iterator[tuple[str, np.ndarray]]:
    """Deterministic random weights with activations of sensible size, as a stream of
    ``(official name, fp32 rows)`` pieces in inventory order (what :func:`write_checkpoint`
    takes), one piece in memory at a time. numpy draws the same numbers in pieces as at once,
    so the values do not depend on the piece size.

    Projections are scaled by 1/sqrt(fan_in) so every layer keeps unit-size activations;
    the mHC, sink and compressor-gate parameters get enough spread that routing, top-k and
    pooling are not degenerate (and index scores rarely tie)."""
    rng = np.random.default_rng(seed)
    for spec in inventory(cfg):
        name, shape = spec.name, spec.shape
        for start, stop in _row_pieces(shape):
            piece = (stop - start, *shape[1:])
            if spec.kind == INDEX:
                # Distinct experts per token, as the released tables have.
                yield name, np.argsort(rng.random((piece[0], cfg.n_routed_experts)), axis=1)[:, :shape[1]].astype(np.int64)
                continue
            if name.endswith("norm.weight"):
                value = 1.0 + 0.1 * rng.standard_normal(piece)
            elif name.endswith(("_scale",)):
                value = 0.5 + 0.1 * rng.standard_normal(piece)
            elif name.endswith(("_base", "attn_sink", "gate.bias")):
                value = 0.5 * rng.standard_normal(piece)
            elif name.endswith(".ape"):
                value = 0.5 * rng.standard_normal(piece)
            elif name.endswith("_fn"):
                value = rng.standard_normal(piece) / np.sqrt(shape[1])
            elif name == "embed.weight":
                value = rng.standard_normal(piece)
            else:
                value = rng.standard_normal(piece) / np.sqrt(shape[-1])
            yield name, value.astype(np.float32)


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """:func:`iter_random_weights` as whole tensors in memory (official names), for small models."""
    pieces: dict[str, list[np.ndarray]] = {}
    for name, rows in iter_random_weights(cfg, seed):
        pieces.setdefault(name, []).append(rows)
    return {name: np.concatenate(parts) for name, parts in pieces.items()}
