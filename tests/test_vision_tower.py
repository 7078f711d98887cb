"""DeepSeek-V4.1's vision tower compiled as ``encode_image`` against a torch re-derivation of the
release's tower, aligner and span (docs/vision.md), on a small random tower (conftest's
V41_VISION_CONFIG): odd grids whose edge the aligner pads, one patch, one row."""

import json

import numpy as np
import pytest

from dsv4c.artifact.file_names import MANIFEST
from dsv4c.artifact.vision import read_vision_manifest
from dsv4c.errors import UsageError
from dsv4c.runtime.engine import Engine

from vision_reference import reference_rows


@pytest.fixture(scope="module")
def vision_engine(v41_vision_artifact):
    return Engine(v41_vision_artifact)


# (patch rows, patch columns): ragged on both axes, exact multiples of the ratio, one patch, one row.
GRIDS = [(7, 5), (6, 9), (1, 1), (1, 14)]


@pytest.mark.parametrize("grid", GRIDS, ids=[f"{a}x{b}" for a, b in GRIDS])
def test_encode_image_matches_the_release_tower(vision_engine, v41_vision_model, grid):
    backend = vision_engine.backend
    geometry, tower, _ = backend.vision
    p = geometry.patch_size
    pixels = np.random.default_rng(sum(grid)).uniform(-1, 1, (3, grid[0] * p, grid[1] * p)).astype(np.float32)
    rows = backend.encode_image(pixels)
    want = reference_rows(v41_vision_model[1], geometry, tower, pixels)
    assert rows.shape == want.shape == (geometry.token_count(*pixels.shape[1:]), geometry.text_hidden)
    assert np.abs(rows - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


def test_the_manifest_carries_the_geometry_and_bad_pixels_are_refused(vision_engine, v41_vision_artifact):
    manifest = json.loads((v41_vision_artifact / MANIFEST).read_text())
    geometry, tower, function = read_vision_manifest(manifest["vision"])
    assert (geometry.patch_size, geometry.downsample_ratio, geometry.image_token_id, geometry.text_hidden) == \
        (4, 3, 271, 64)
    assert geometry.image_mean == geometry.image_std == (0.5, 0.5, 0.5)
    assert (tower.hidden_size, tower.num_layers, tower.max_patches, function) == (64, 2, 61 * 9, "encode_image")
    backend = vision_engine.backend
    for shape in [(3, 6, 8), (1, 8, 8), (3, 0, 8), (3, 4, 4 * 550)]:
        with pytest.raises(UsageError):
            backend.encode_image(np.zeros(shape, np.float32))


def test_a_text_only_artifact_refuses_images(tiny_llvm):
    with pytest.raises(UsageError, match="no vision tower"):
        Engine(tiny_llvm).backend.encode_image(np.zeros((3, 28, 28), np.float32))
