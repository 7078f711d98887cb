"""Checkpoints: the tensor inventory of a config, a streaming loader, and a quantizing writer.

The inventory (:func:`inventory`) is the one place that says which tensors a V4 checkpoint
holds, their logical shapes and their storage kind (SPEC §3). The loader reads official
names and ``transformers`` names, shard by shard and tensor by tensor, and dequantizes
FP8 128x128 blocks and FP4 1x32 groups to fp32. The writer produces the official format
with the same scale rules (E8M0 power-of-two scales), atomically.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from dsv4c.errors import CheckpointError, UsageError
from dsv4c.frontend import lowbit
from dsv4c.frontend.config import CSA, HASH_MOE, LayerSpec, ModelConfig
from dsv4c.frontend.safetensors_io import SafetensorsFile, write_safetensors

# Storage kinds of SPEC §3.
DENSE = "dense"  # FP8 e4m3 with 128x128 block scales in released checkpoints
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
        if spec.name in self._merged:
            return self._read_merged(spec)
        if spec.name not in self._where:
            raise CheckpointError(f"{self.path}: missing tensor {spec.name} (expected shape {list(spec.shape)})")
        f, stored = self._where[spec.name]
        st = self._open(f)
        dtype, shape = st.dtype(stored), tuple(st.shape(stored))
        where = f"{f.name}: tensor {spec.name}"
        if spec.kind == INDEX:
            if dtype not in ("I64", "I32"):
                raise CheckpointError(f"{where} has dtype {dtype}; expected I64 or I32")
            value = st.read_raw(stored).astype(np.int64)
        elif dtype in ("F32", "BF16", "F16"):
            value = st.read_f32(stored)
        elif dtype == "F8_E4M3" and spec.kind in (DENSE, EXPERT):
            value = self._dequant_fp8(st, stored, spec, shape, where)
        elif dtype in ("I8", "U8") and spec.kind == EXPERT:
            value = self._dequant_fp4(st, stored, spec, shape, where)
        else:
            raise CheckpointError(f"{where} has dtype {dtype}, which is not a valid storage for a {spec.kind} tensor")
        if tuple(value.shape) != spec.shape:
            raise CheckpointError(f"{where} has shape {list(value.shape)}; the config implies {list(spec.shape)}")
        if spec.kind == INDEX and n_experts is not None and ((value < 0) | (value >= n_experts)).any():
            raise CheckpointError(f"{where} holds expert ids outside [0, {n_experts})")
        return value

    def _companion_scale(self, name: str, where: str) -> tuple[SafetensorsFile, str, str]:
        official = _scale_name(name)
        if official not in self._where:
            raise CheckpointError(f"{where} is quantized but its scale tensor {official} is missing")
        f, stored = self._where[official]
        st = self._open(f)
        return st, stored, st.dtype(stored)

    def _dequant_fp8(self, st, stored, spec, shape, where) -> np.ndarray:
        sst, sname, sdtype = self._companion_scale(spec.name, where)
        if len(shape) != 2:
            raise CheckpointError(f"{where}: FP8 tensors must be 2-D, got {list(shape)}")
        grid = (-(-shape[0] // 128), -(-shape[1] // 128))
        if tuple(sst.shape(sname)) != grid:
            raise CheckpointError(f"{where}: scale has shape {list(sst.shape(sname))}; 128x128 blocks need {list(grid)}")
        fmt = {"F8_E8M0": "e8m0", "F32": "fp32", "U8": "e8m0"}.get(sdtype)
        if fmt is None:
            raise CheckpointError(f"{where}: scale dtype {sdtype} is neither E8M0 nor F32")
        return lowbit.dequantize_fp8_blocks(st.read_raw(stored), sst.read_raw(sname), 128, fmt)

    def _dequant_fp4(self, st, stored, spec, shape, where) -> np.ndarray:
        sst, sname, sdtype = self._companion_scale(spec.name, where)
        if len(shape) != 2 or (2 * shape[1]) % 32:
            raise CheckpointError(f"{where}: packed FP4 tensors must be 2-D with 16k columns, got {list(shape)}")
        want = (shape[0], 2 * shape[1] // 32)
        if sdtype not in ("F8_E8M0", "U8") or tuple(sst.shape(sname)) != want:
            raise CheckpointError(f"{where}: FP4 scale must be E8M0 of shape {list(want)}")
        return lowbit.dequantize_fp4_groups(st.read_raw(stored), sst.read_raw(sname), 32)

    def _read_merged(self, spec: TensorSpec) -> np.ndarray:
        f, stored, slot = self._merged[spec.name]
        st = self._open(f)
        if st.dtype(stored) not in ("F32", "BF16", "F16"):
            raise CheckpointError(f"{f.name}: merged expert tensor {stored} must be a float tensor")
        merged = st.read_f32(stored)  # [E, 2I, D] (gate_up) or [E, D, I] (down)
        e, half = divmod(slot, 2)
        if stored.endswith("gate_up_proj"):
            inter = merged.shape[1] // 2
            value = merged[e, half * inter:(half + 1) * inter]
        else:
            value = merged[e]
        if tuple(value.shape) != spec.shape:
            raise CheckpointError(f"{f.name}: {spec.name} (from {stored}) has shape {list(value.shape)}; "
                                  f"the config implies {list(spec.shape)}")
        return np.ascontiguousarray(value)


def load_weights(cfg: ModelConfig, path: str | os.PathLike, names: set[str] | None = None,
                 progress: bool = False) -> dict[str, np.ndarray]:
    """Read every tensor of the inventory (or those in ``names``) and build the IR's weights:
    routed experts are stacked into ``<layer>.ffn.experts.w{1,2,3}`` of shape ``[E, out, in]``."""
    every = inventory(cfg)
    if names is not None:
        unknown = sorted(set(names) - {_ir_name(s.name) for s in every})
        if unknown:
            raise UsageError(f"load_weights: {unknown[0]} is not a weight of this model ({len(unknown)} unknown names)")
    specs = [s for s in every if names is None or _ir_name(s.name) in names]
    official: dict[str, np.ndarray] = {}
    with Checkpoint(path) as ckpt:
        if names is None:
            # A checkpoint of a deeper or wider model (more layers, experts, an MTP block)
            # would otherwise load as a truncated one without a word.
            known = {s.name for s in specs} | {_scale_name(s.name) for s in specs if s.kind in (DENSE, EXPERT)}
            extra = [n for n in ckpt.names() if n not in known]
            if extra:
                raise CheckpointError(f"{ckpt.path}: holds {len(extra)} tensors the config does not describe, e.g. "
                                      f"{extra[0]}; the checkpoint does not match the model configuration")
        it = specs
        if progress:
            from tqdm import tqdm

            it = tqdm(specs, desc="loading weights", unit="tensor", leave=False)
        for spec in it:
            official[spec.name] = ckpt.read(spec, cfg.n_routed_experts)
    return ir_weights(official)


def ir_weights(official: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Official-name tensors by their IR names: per-expert projections stacked in expert order."""
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, list[np.ndarray]] = {}
    for name, value in official.items():  # the inventory lists experts in order
        ir = _ir_name(name)
        if ir != name:
            stacks.setdefault(ir, []).append(value)
        else:
            out[name] = value
    out.update({ir: np.stack(parts) for ir, parts in stacks.items()})
    return out


def _ir_name(official: str) -> str:
    """``layers.3.ffn.experts.5.w1.weight`` -> ``layers.3.ffn.experts.w1``; others unchanged."""
    m = re.match(r"^(.*\.ffn\.experts)\.\d+\.(w[123])\.weight$", official)
    return f"{m[1]}.{m[2]}" if m else official


# --------------------------------------------------------------------------- writing


def _encode(spec: TensorSpec, value: np.ndarray, cfg: ModelConfig) -> dict[str, tuple[str, np.ndarray]]:
    """The stored tensors (value and, when quantized, its scale) of one logical tensor."""
    fmt = cfg.weights
    if spec.kind == INDEX:
        return {spec.name: ("I64", value.astype(np.int64))}
    storage = {DENSE: fmt.dense, EXPERT: fmt.experts, BF16: "fp32" if fmt.dense == "fp32" else "bf16",
               FP32: "fp32"}[spec.kind]
    value = np.asarray(value, np.float32)
    if storage == "fp8":
        codes, scales = lowbit.quantize_fp8_blocks(value, 128, fmt.scale)
        scale = ("F8_E8M0", scales) if fmt.scale == "e8m0" else ("F32", scales.astype(np.float32))
        return {spec.name: ("F8_E4M3", codes), _scale_name(spec.name): scale}
    if storage == "fp4":
        packed, scales = lowbit.quantize_fp4_groups(value, 32)
        return {spec.name: ("I8", packed), _scale_name(spec.name): ("F8_E8M0", scales)}
    if storage == "bf16":
        return {spec.name: ("BF16", lowbit.bf16_bits_from_f32(value))}
    return {spec.name: ("F32", value)}


def write_checkpoint(cfg: ModelConfig, weights: dict[str, np.ndarray], out_dir: str | os.PathLike,
                     shard_bytes: int = 2 << 30, spelling: str | None = None, progress: bool = False) -> Path:
    """Write ``config.json`` + official-format shards for ``weights`` (official names, fp32).

    Written into a temporary directory next to ``out_dir`` and renamed at the end: an
    interrupted write leaves nothing at ``out_dir``."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out}: exists and is not an empty directory; choose a new directory")
    specs = inventory(cfg)
    extra = sorted(set(weights) - {s.name for s in specs})
    if extra:
        raise CheckpointError(f"cannot write checkpoint: tensor {extra[0]} is not in the model's inventory "
                              f"({len(extra)} such tensors; official names, one tensor per expert)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        shards: list[dict[str, tuple[str, np.ndarray]]] = [{}]
        size = 0
        it = specs
        if progress:
            from tqdm import tqdm

            it = tqdm(specs, desc="writing checkpoint", unit="tensor", leave=False)
        for spec in it:
            if spec.name not in weights:
                raise CheckpointError(f"cannot write checkpoint: tensor {spec.name} was not provided")
            value = np.asarray(weights[spec.name])
            if value.shape != spec.shape:
                raise CheckpointError(f"cannot write checkpoint: tensor {spec.name} has shape {list(value.shape)}; "
                                      f"the config implies {list(spec.shape)}")
            stored = _encode(spec, value, cfg)
            nbytes = sum(a.nbytes for _, a in stored.values())
            if size and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1].update(stored)
            size += nbytes
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(tmp / fname, shard, {"format": "pt"})
            for name, (_, a) in shard.items():
                weight_map[name] = fname
                total += a.nbytes
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
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic random weights with activations of sensible size (fp32, official names).

    Projections are scaled by 1/sqrt(fan_in) so every layer keeps unit-size activations;
    the mHC, sink and compressor-gate parameters get enough spread that routing, top-k and
    pooling are not degenerate (and index scores rarely tie)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for spec in inventory(cfg):
        name, shape = spec.name, spec.shape
        if spec.kind == INDEX:
            # Distinct experts per token, as the released tables have.
            out[name] = np.argsort(rng.random((shape[0], cfg.n_routed_experts)), axis=1)[:, :shape[1]].astype(np.int64)
            continue
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(("_scale",)):
            value = 0.5 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(("_base", "attn_sink", "gate.bias")):
            value = 0.5 * rng.standard_normal(shape)
        elif name.endswith(".ape"):
            value = 0.5 * rng.standard_normal(shape)
        elif name.endswith("_fn"):
            value = rng.standard_normal(shape) / np.sqrt(shape[1])
        elif name == "embed.weight":
            value = rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-1])
        out[name] = value.astype(np.float32)
    return out
