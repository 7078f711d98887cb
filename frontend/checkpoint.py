"""Reading checkpoints: a single ``.safetensors`` file or a directory of shards, under official
or ``transformers`` names. Every tensor is checked against the inventory from the shard
headers alone; then the reader hands out row ranges in the checkpoint's own storage
(``artifact.rows.Rows``: FP8 / FP4 codes with their scales, BF16 bits), or whole tensors
dequantized to fp32 for models that fit in memory.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from dsv4c.artifact import lowbit
from dsv4c.artifact.model_config import ModelConfig
from dsv4c.artifact.quant import FP8_BLOCK_SIZES
from dsv4c.artifact.rows import ConcatRows, Rows, RowSource
from dsv4c.artifact.safetensors_io import SafetensorsFile
from dsv4c.errors import CheckpointError, UsageError
from dsv4c.frontend.tensor_inventory import DENSE, EXPERT, INDEX, TABLE, TensorSpec, inventory, scale_name

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
    # V4.1's spelling of the DSpark Markov head; 0731's is the official one here.
    (r"\.markov_head\.embed\.weight$", ".markov_head.markov_w1.weight"),
    (r"\.markov_head\.head\.weight$", ".markov_head.markov_w2.weight"),
]
_HF_RULES = [(re.compile(a), b) for a, b in _HF_TO_OFFICIAL]
_HF_MERGED_EXPERTS = re.compile(r"^(?P<prefix>.*\.ffn\.experts)\.(?P<which>gate_up_proj|down_proj)$")


VISION_PREFIXES = ("vision.", "aligner.", "image_")  # V4.1's vision tower (frontend.vision)


def official_name(name: str) -> str:
    """Map a ``transformers`` tensor name to the official one (official names pass through; so
    do V4.1's vision tensors, whose ``.mlp.`` is the release's own name)."""
    if name.startswith(VISION_PREFIXES):
        return name
    for pattern, repl in _HF_RULES:
        name = pattern.sub(repl, name)
    return name


FLOAT_STORAGE = ("F32", "F16", "BF16")
TABLE_SCALE_COLUMNS = 32
# Tensors of a V4.1 checkpoint that are not the text model dsv4c compiles: the DSpark drafter
# (compiled for V4.1 by a later change) and the vision tower with its aligner and image markers
# (compiled as encode_image from the composite config, whose vision tensors compile.py reads).
V41_SKIPPED_PREFIXES = ("mtp.", *VISION_PREFIXES)


def skipped_v41_tensors(cfg: ModelConfig, names) -> list[str]:
    """The checkpoint tensors of ``names`` a V4.1 model leaves unread, said once on stderr."""
    if cfg.family != "v4.1":
        return []
    skipped = [n for n in names if n.startswith(V41_SKIPPED_PREFIXES)]
    if skipped:
        parts = [what for prefixes, what in ((("mtp.",), "the DSpark drafter (mtp.*)"),
                                             (VISION_PREFIXES, "the vision tower (vision.*, aligner.*, image_*)"))
                 if any(n.startswith(prefixes) for n in skipped)]
        print(f"dsv4c: note: ignoring {len(skipped)} checkpoint tensors of {' and '.join(parts)}: dsv4c compiles "
              "V4.1's text model without them", file=sys.stderr)
    return skipped


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
            sst, sname, fmt, block, rows_per_scale = self.scale
            first = start // rows_per_scale
            grid = sst.read_rows(sname, first, -(-stop // rows_per_scale))
            grid = lowbit.decode_e8m0(grid) if fmt == "e8m0" else grid.astype(np.float32)
            scales = grid[np.arange(start, stop) // rows_per_scale - first]
            return [Rows(self.storage, values, scales, block)]
        elif self.storage == "FP4":
            values = values.view(np.uint8)
            sst, sname, _ = self.scale
            scales = sst.read_rows(sname, start, stop)
        return [Rows(self.storage, values, scales)]


DRAFT_PREFIX = "mtp."  # the drafter's tensors (V4's MTP layer, or DSpark's stages)


def _shard_files(p: Path) -> list[Path]:
    """The safetensors files of a checkpoint: a file, an index, or a directory of shards."""
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


class Checkpoint:
    """A single ``.safetensors`` file or a directory of shards, read tensor by tensor; with a
    ``drafter`` checkpoint, the ``mtp.*`` tensors come from it and only from it."""

    def __init__(self, path: str | os.PathLike, drafter: str | os.PathLike | None = None):
        self.path = Path(path)
        self._files: dict[Path, SafetensorsFile] = {}
        self._where: dict[str, tuple[Path, str]] = {}  # official name -> (file, stored name)
        self._merged: dict[str, tuple[Path, str, int]] = {}  # virtual per-expert name -> merged tensor
        sources = [(self.path, lambda name: drafter is None or not name.startswith(DRAFT_PREFIX))]
        if drafter is not None:
            sources.append((Path(drafter), lambda name: name.startswith(DRAFT_PREFIX)))
        try:
            for path, wanted in sources:
                for f in _shard_files(path):
                    st = self._open(f)
                    for stored in st.names():
                        if wanted(name := official_name(stored)):
                            self._add(name, f, stored)
        except BaseException:
            self.close()
            raise

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
        the spec from the headers alone (the storage its kind allows); expert ids in tid2eid are
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
        elif dtype == "F8_E4M3" and spec.kind == TABLE:
            storage, scale = "FP8", self._row_scale(spec.name, shape, where)
        elif dtype in ("I8", "U8") and spec.kind == EXPERT:
            storage, scale = "FP4", self._fp4_scale(spec.name, shape, where)
            logical = (shape[0], 2 * shape[1])
        else:
            raise CheckpointError(f"{where} has dtype {dtype}, which is not a valid storage for a {spec.kind} tensor")
        if logical != spec.shape:
            raise CheckpointError(f"{where} has shape {list(logical)}; the config implies {list(spec.shape)}")
        return TensorRows(where, st, stored, storage, spec.shape, scale, n_experts=n_experts)

    def _companion_scale(self, name: str, where: str) -> tuple[SafetensorsFile, str, str]:
        official = scale_name(name)
        if official not in self._where:
            raise CheckpointError(f"{where} is quantized but its scale tensor {official} is missing")
        f, stored = self._where[official]
        st = self._open(f)
        return st, stored, st.dtype(stored)

    def _fp8_scale(self, name: str, shape: tuple[int, ...], where: str
                   ) -> tuple[SafetensorsFile, str, str, int, int]:
        """The scale tensor of an FP8 tensor, its format, its block size, which its shape tells
        (blocks of every size agree on a tensor of one block), and the rows one scale row covers."""
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
        return sst, sname, fmt, block, block

    def _row_scale(self, name: str, shape: tuple[int, ...], where: str) -> tuple[SafetensorsFile, str, str, int, int]:
        """An Engram table's scales: one per 32 columns of each row (they do not tile like weight blocks)."""
        sst, sname, sdtype = self._companion_scale(name, where)
        want = [shape[0], -(-shape[1] // TABLE_SCALE_COLUMNS)]
        fmt = {"F8_E8M0": "e8m0", "F32": "fp32", "U8": "e8m0"}.get(sdtype)
        if len(shape) != 2 or list(sst.shape(sname)) != want or fmt is None:
            raise CheckpointError(f"{where}: an FP8 table needs an E8M0 or F32 scale of shape {want} "
                                  f"(one per {TABLE_SCALE_COLUMNS} columns of a row)")
        return sst, sname, fmt, TABLE_SCALE_COLUMNS, 1

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
            known = {s.name for s in every} | {scale_name(s.name) for s in every if s.kind in (DENSE, EXPERT, TABLE)}
            known.update(skipped_v41_tensors(cfg, ckpt.names()))
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
