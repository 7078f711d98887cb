"""Writing checkpoints in the official format (official names, the same scale rules: E8M0
power-of-two or fp32 block scales) from whole tensors or a stream of row pieces, a few threads
quantizing and writing while the next piece is made, atomically.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import numpy as np

from dsv4c.artifact import lowbit
from dsv4c.artifact.model_config import ModelConfig
from dsv4c.artifact.safetensors_io import STORAGE_DTYPES, SafetensorsWriter
from dsv4c.errors import CheckpointError
from dsv4c.frontend.tensor_inventory import BF16, DENSE, EXPERT, FP32, INDEX, TABLE, TensorSpec, inventory, scale_name
from dsv4c.threads import BoundedPool

# Rows generated, quantized and written at a time: float64 bytes of random values (a 128-row
# multiple, so FP8 blocks, 128 or 32 rows, never straddle two pieces). The writers hold a few
# pieces at once, and quantizing one takes about ten times its float32 size in int64 temporaries.
PIECE_BYTES = 8 << 20


def row_pieces(shape: tuple[int, ...], itemsize: int = 8) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges along the first axis of a tensor, about PIECE_BYTES each."""
    row_bytes = max(math.prod(shape[1:]) * itemsize, 1)
    step = max(128, PIECE_BYTES // row_bytes // 128 * 128)
    return [(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]


def _storage(spec: TensorSpec, cfg: ModelConfig) -> str:
    """How the checkpoint of ``cfg`` stores ``spec``: index, fp8, fp8_rows (one scale per 32
    columns of a row: Engram tables), fp4, bf16 or fp32."""
    fmt = cfg.weights
    if spec.kind == INDEX:
        return "index"
    if spec.kind == TABLE:
        return {"fp8": "fp8_rows", "fp32": "fp32"}.get(fmt.dense, "bf16")
    return {DENSE: fmt.dense, EXPERT: fmt.experts, BF16: "fp32" if fmt.dense == "fp32" else "bf16",
            FP32: "fp32"}[spec.kind]


def _stored_entries(spec: TensorSpec, cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The stored tensors (value and, when quantized, its scale) of one logical tensor: dtype and shape."""
    storage, shape = _storage(spec, cfg), spec.shape
    if storage == "fp8":
        block = cfg.weights.fp8_block
        grid = (-(-shape[0] // block), -(-shape[1] // block))
        return {spec.name: ("F8_E4M3", shape),
                scale_name(spec.name): ("F8_E8M0" if cfg.weights.scale == "e8m0" else "F32", grid)}
    if storage == "fp4":
        return {spec.name: ("I8", (shape[0], shape[1] // 2)), scale_name(spec.name): ("F8_E8M0", (shape[0], shape[1] // 32))}
    if storage == "fp8_rows":
        return {spec.name: ("F8_E4M3", shape), scale_name(spec.name): ("F8_E8M0", (shape[0], shape[1] // 32))}
    return {spec.name: ({"index": "I64", "bf16": "BF16"}.get(storage, "F32"), shape)}


def _encode(spec: TensorSpec, rows: np.ndarray, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The stored bytes of rows of one logical tensor (FP8 pieces start on a row block)."""
    storage = _storage(spec, cfg)
    if storage == "index":
        return {spec.name: rows.astype(np.int64)}
    rows = np.asarray(rows, np.float32)
    if storage == "fp8":
        codes, scales = lowbit.quantize_fp8_blocks(rows, cfg.weights.fp8_block, cfg.weights.scale)
        return {spec.name: codes, scale_name(spec.name): scales}
    if storage == "fp4":
        packed, scales = lowbit.quantize_fp4_groups(rows, 32)
        return {spec.name: packed, scale_name(spec.name): scales}
    if storage == "fp8_rows":
        codes, scales = lowbit.quantize_fp8_row_groups(rows, 32)
        return {spec.name: codes, scale_name(spec.name): scales}
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
            for start, stop in row_pieces(spec.shape, value.itemsize):
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
