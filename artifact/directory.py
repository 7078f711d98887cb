"""An artifact directory opened: its checked manifest, the model it was compiled for and the KV
pool geometry, each read once from the manifest (the runtimes take them from here rather than
re-reading JSON or re-deriving them)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from dsv4c.artifact.file_names import MANIFEST
from dsv4c.artifact.manifest import Manifest, read_manifest
from dsv4c.artifact.model_config import ModelConfig
from dsv4c.artifact.pool import PoolGeometry


@dataclass(frozen=True)
class Artifact:
    path: Path
    manifest: Manifest
    config: ModelConfig  # the manifest's ``model``
    geometry: PoolGeometry  # the manifest's ``pool_geometry``, cross-checked against ``config``


def open_artifact(path: str | os.PathLike, verify: bool = False) -> Artifact:
    """The artifact at ``path``, checked as :func:`~dsv4c.artifact.manifest.read_manifest`
    checks it (``verify``: every byte hashed); a damaged or older one is an
    :class:`~dsv4c.errors.ArtifactError` in one line. Whether this host can run its target is
    the runtime's to check (it needs the device)."""
    path = Path(path)
    manifest = read_manifest(path, verify=verify)
    where = str(path / MANIFEST)
    config = ModelConfig.from_json_dict(manifest.model, manifest.model_name, where)
    return Artifact(path, manifest, config, PoolGeometry.from_summary(manifest.pool_geometry, config, where))
