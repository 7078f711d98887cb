"""DeepSeek-V4.1's Engram tables as the artifact holds them: one file per Engram layer
(``file_names.engram_table_file``), apart from the weights, that the runtime maps (or reads) and
of which each step reads only the rows its n-grams hash to (docs/artifact.md, "Engram tables").

A table file holds the tensor ``rows`` ``[R, de]`` and, in format :data:`FP8_TABLE`, ``scales``
``[R, ceil(de / 32)]``: e4m3fn codes with one E8M0 exponent code per 32 columns of a row, the
bytes the release's checkpoint stores (both as U8, like the artifact's other FP8 codes); row
``r`` column ``c`` is ``e4m3(rows[r, c]) * 2^(scales[r, c // 32] - 127)``. In format
:data:`FP32_TABLE` (a checkpoint of float tables: bf16 / f16 / f32) ``rows`` is float32 and there
are no scales. Which format a model's tables take follows its dense weights
(:func:`table_format`): a checkpoint that stores the other one is converted as it is copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsv4c.artifact import lowbit
from dsv4c.artifact.model_config import ModelConfig
from dsv4c.errors import CheckpointError

FP8_TABLE, FP32_TABLE = "fp8_e4m3_e8m0", "fp32"
TABLE_FORMATS = (FP8_TABLE, FP32_TABLE)
SCALE_COLUMNS = 32  # columns of a row one E8M0 scale covers
ROWS, SCALES = "rows", "scales"  # the tensors of a table file


def table_weight(layer: int) -> str:
    """The IR weight (and checkpoint tensor) that decoder layer ``layer``'s table is."""
    return f"layers.{layer}.engram.embed.weight"


def table_format(cfg: ModelConfig) -> str:
    """The format of ``cfg``'s tables in an artifact: FP8 rows with E8M0 scales where the
    checkpoint's dense weights are FP8 (the release), else float32."""
    return FP8_TABLE if cfg.weights.dense == "fp8" else FP32_TABLE


def table_inputs(layer: int, fmt: str) -> tuple[str, ...]:
    """The compiled step's inputs that carry decoder layer ``layer``'s table (after ``engram_rows``,
    Engram layer by Engram layer): its rows and, in FP8, their scales (``vm.inputs``)."""
    return (f"engram_table.{layer}",) + ((f"engram_scale.{layer}",) if fmt == FP8_TABLE else ())


def table_tensors(fmt: str, rows: int, width: int) -> dict[str, tuple[str, tuple[int, int]]]:
    """The tensors of a table file: name -> (safetensors dtype, shape)."""
    if fmt == FP32_TABLE:
        return {ROWS: ("F32", (rows, width))}
    return {ROWS: ("U8", (rows, width)), SCALES: ("U8", (rows, -(-width // SCALE_COLUMNS)))}


def lay_out_rows(fmt: str, parts, where: str) -> dict[str, np.ndarray]:
    """The table file's arrays (by tensor) of consecutive rows, given as the checkpoint holds them
    (``artifact.rows.Rows``, one per stored tensor): FP8 rows keep their codes and their scales
    become E8M0 codes again (they must be powers of two), float rows are quantized by the
    checkpoint's own rule (``lowbit.quantize_fp8_row_groups``); format fp32 decodes them."""
    if fmt == FP32_TABLE:
        return {ROWS: np.concatenate([p.decode() for p in parts]).astype(np.float32, copy=False)}
    codes, scales = [], []
    for p in parts:
        if p.storage == "FP8":
            try:
                scales.append(lowbit.encode_e8m0(p.scales))
            except ValueError:
                raise CheckpointError(f"{where}: an FP8 table's scales must be powers of two (E8M0)") from None
            codes.append(p.values)
        else:
            c, s = lowbit.quantize_fp8_row_groups(p.decode(), SCALE_COLUMNS)
            codes.append(c)
            scales.append(s)
    return {ROWS: np.concatenate(codes).view(np.uint8), SCALES: np.concatenate(scales).view(np.uint8)}


@dataclass(frozen=True, eq=False)
class EngramTable:
    """One Engram layer's table as a backend holds it: ``rows`` and ``scales`` arrays (mapped from
    the file, read into memory, or a step's compact gather of them), in ``format``."""

    layer: int
    format: str
    rows: np.ndarray  # [R, de]: uint8 e4m3fn codes (FP8_TABLE) or float32
    scales: np.ndarray | None  # [R, ceil(de / 32)] uint8 E8M0 codes (FP8_TABLE only)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.rows.shape)

    @property
    def arrays(self) -> list[np.ndarray]:
        """What the step takes for this table (the inputs :func:`table_inputs` names): its rows,
        and its scales where it has them."""
        return [self.rows] + ([] if self.scales is None else [self.scales])

    def __getitem__(self, ids) -> np.ndarray:
        """The float32 rows ``ids`` (any shape) names, ``[*ids.shape, de]``: only those rows are read."""
        rows = self.rows[ids]
        if self.format == FP32_TABLE:
            return np.array(rows, np.float32)
        scale = np.repeat(lowbit.decode_e8m0(self.scales[ids]), SCALE_COLUMNS, axis=-1)[..., :rows.shape[-1]]
        return lowbit.decode_e4m3fn(rows) * scale

    def compact(self, ids: np.ndarray, rows: int | None = None) -> tuple[EngramTable, np.ndarray]:
        """The rows ``ids`` names, each once (in row order), padded with zero rows to ``rows`` when
        given (a step whose shapes must depend on its tokens alone), and ``ids`` remapped into them."""
        unique, inverse = np.unique(ids, return_inverse=True)

        def gathered(a: np.ndarray) -> np.ndarray:
            if rows is None:
                return a[unique]
            out = np.zeros((max(rows, len(unique)), a.shape[1]), a.dtype)
            out[:len(unique)] = a[unique]
            return out

        scales = None if self.scales is None else gathered(self.scales)
        return EngramTable(self.layer, self.format, gathered(self.rows), scales), inverse.reshape(ids.shape)


def table_problem(tensors: dict[str, tuple[str, tuple[int, ...]]], fmt: str, rows: int, width: int) -> str | None:
    """What makes a table file's tensors (name -> (dtype, shape), from its header) not the table
    the manifest records, in a few words, or None."""
    want = table_tensors(fmt, rows, width)
    if set(tensors) != set(want):
        return f"holds tensors {sorted(tensors)}, a {fmt} table holds {sorted(want)}"
    for name, (dtype, shape) in want.items():
        if (tensors[name][0], tuple(tensors[name][1])) != (dtype, shape):
            return f"tensor {name!r} is {tensors[name][0]} {list(tensors[name][1])}, the manifest implies {dtype} " \
                   f"{list(shape)}"
    return None
