"""The one loader of an artifact's weights, for every backend.

:func:`open_weights` maps the weight files instead of reading them: start-up costs the
headers, the OS pages weights in as the kernels first touch them (at the disk's speed) and
can drop them again under memory pressure. Each array is read-only, in its storage dtype
(``SafetensorsFile.read_raw``'s: uint8 for FP8 / FP4 / E8M0 codes, uint16 for BF16 bits,
float32, int32, int64), stacked weights as one array. Tensors of a 64-byte multiple size
start 64-byte aligned in the file (and the map is page aligned), so TVM can share them
without a copy; numpy refuses to export read-only arrays through plain ``__dlpack__()``, so
hand TVM the versioned capsule: ``tvm.runtime.from_dlpack(a.__dlpack__(max_version=(1, 0)))``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from dsv4c.frontend.safetensors_io import SafetensorsFile
from dsv4c.runtime.artifact import ArtifactError


def open_weights(artifact: str | Path, manifest: dict[str, Any]) -> Mapping[str, np.ndarray]:
    """Every weight of the artifact by name, memory-mapped from its shards (read-only arrays).

    ``manifest`` is :func:`~dsv4c.runtime.artifact.read_manifest`'s, which has checked that
    every file is there with its size. Here each shard's header is parsed and checked
    (:class:`~dsv4c.errors.CheckpointError` naming the file), and the index against the
    shards: every tensor in exactly the file the index names. No tensor data is read."""
    d = Path(artifact)
    weights = manifest.get("weights")
    if not manifest.get("has_weights"):
        raise ArtifactError(f"{d}: compiled with --no-weights, so there are no weights to load; compile it again "
                            "from a model directory")
    files = weights.get("files") if isinstance(weights, dict) else None
    if not (isinstance(files, list) and all(isinstance(f, str) for f in files) and isinstance(weights.get("index"), str)):
        raise ArtifactError(f"{d / 'manifest.json'}: manifest has no weight file list; recompile")
    index_path = d / weights["index"]
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        by_file: dict[str, set[str]] = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, set()).add(name)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ArtifactError(f"{index_path}: not a valid weight index; recompile") from None
    if sorted(by_file) != sorted(files):
        raise ArtifactError(f"{index_path}: does not name the weight files the manifest lists; recompile")
    out: dict[str, np.ndarray] = {}
    for file in files:
        with SafetensorsFile(d / file) as st:
            if set(st.names()) != by_file[file]:
                stray = sorted(set(st.names()) ^ by_file[file])[0]
                raise ArtifactError(f"{d}: {file} and {weights['index']} disagree about tensor {stray}; recompile")
            out.update(st.mapped())
    return MappingProxyType(out)
