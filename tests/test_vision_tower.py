"""DeepSeek-V4.1's vision tower compiled as ``encode_image`` against a torch re-derivation of the
release's tower, aligner and span (docs/vision.md), on a small random tower (conftest's
V41_VISION_CONFIG): odd grids whose edge the aligner pads, one patch, one row."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dsv4c.artifact.file_names import MANIFEST
from dsv4c.artifact.vision import read_vision_manifest
from dsv4c.errors import UsageError
from dsv4c.runtime.engine import Engine


def reference_rows(w: dict, geometry, tower, pixels: np.ndarray) -> np.ndarray:
    """The span rows of ``pixels`` [3, H, W], in float64, written from the release's ops."""
    t = {k: torch.from_numpy(v).double() for k, v in w.items()}
    p, r, d, heads = geometry.patch_size, geometry.downsample_ratio, tower.hidden_size, tower.num_heads
    _, height, width = pixels.shape
    gh, gw = height // p, width // p
    x = torch.from_numpy(pixels).double()
    patches = x.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3 * p * p)
    h = patches @ t["vision.patch_embed.proj.weight"].T + t["vision.patch_embed.proj.bias"]
    half = d // heads // 2
    inv = 1.0 / tower.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float64) / half)
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    freqs = (torch.stack([rows, cols], -1).reshape(-1, 2, 1).double() * inv).flatten(1)
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]

    def rope(v):
        a, b = v.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    def rms(v, weight):
        return weight * v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + tower.norm_eps)

    n = gh * gw
    for layer in range(tower.num_layers):
        b = f"vision.blocks.{layer}."
        qkv = rms(h, t[b + "norm1.weight"]) @ t[b + "attn.wqkv.weight"].T + t[b + "attn.wqkv.bias"]
        q, k, v = (z.reshape(n, heads, -1) for z in qkv.chunk(3, dim=-1))
        o = F.scaled_dot_product_attention(rope(q).transpose(0, 1), rope(k).transpose(0, 1), v.transpose(0, 1))
        h = h + o.transpose(0, 1).reshape(n, d) @ t[b + "attn.wo.weight"].T + t[b + "attn.wo.bias"]
        gate, up = (rms(h, t[b + "norm2.weight"]) @ t[b + "mlp.w1.weight"].T).chunk(2, dim=-1)
        h = h + (F.silu(gate) * up) @ t[b + "mlp.w2.weight"].T
    h = rms(h, t["vision.norm.weight"])
    grid = F.pad(h.reshape(gh, gw, d).permute(2, 0, 1), (0, -gw % r, 0, -gh % r))
    merged = F.unfold(grid[None], r, stride=r)[0].T
    e = F.gelu(merged @ t["aligner.w1.weight"].T + t["aligner.w1.bias"]) @ t["aligner.w2.weight"].T \
        + t["aligner.w2.bias"]
    mh, mw = -(-gh // r), -(-gw // r)
    span = [t["image_start"][None]]
    for y in range(mh):
        span += [e[y * mw:(y + 1) * mw], t["image_newline"][None]]
    return torch.cat(span + [t["image_end"][None]]).numpy()


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
