"""DeepSeek-V4.1's vision geometry and tower, as the manifest carries them (key ``"vision"``,
absent for a text-only model): what the image processor needs (:class:`VisionGeometry`), the
tower's widths the compiled ``encode_image`` was built for (:class:`VisionTower`), and the one
place of the span's arithmetic (:func:`image_grid`, :func:`span_token_count`).

``encode_image`` takes ``pixels`` float32 ``[3, H, W]`` (RGB, normalized by ``image_mean`` /
``image_std``, H and W multiples of ``patch_size``) and returns the image span's rows
``[span_token_count, text_hidden]`` in prompt order: ``image_start``, then per row of the
aligner's grid its tokens and an ``image_newline``, then ``image_end`` (docs/vision.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from dsv4c.errors import ArtifactError, UsageError

# The release's image processor normalizes each channel by (v / 255 - 0.5) / 0.5.
RELEASE_IMAGE_MEAN = (0.5, 0.5, 0.5)
RELEASE_IMAGE_STD = (0.5, 0.5, 0.5)


def image_grid(height: int, width: int, patch_size: int, downsample_ratio: int) -> tuple[int, int, int, int]:
    """(ViT patch rows, patch columns, aligner token rows, token columns) of pixels ``height`` x
    ``width`` (multiples of ``patch_size``): the aligner merges ``downsample_ratio`` squared
    patches into one token, the grid's ragged edge zero-padded."""
    gh, gw = height // patch_size, width // patch_size
    return gh, gw, -(-gh // downsample_ratio), -(-gw // downsample_ratio)


def span_token_count(token_rows: int, token_columns: int) -> int:
    """Prompt positions of an image span: start, each row's tokens and its newline, end."""
    return token_rows * (token_columns + 1) + 2


@dataclass(frozen=True)
class VisionGeometry:
    """What turns an image into ``encode_image``'s pixels and its prompt positions."""

    patch_size: int
    downsample_ratio: int
    max_image_tokens: int  # the whole span, start / newlines / end included
    min_pixels: int  # smaller images are upscaled to at least this area
    max_wh_ratio: float | None  # None: no aspect cap (V4.1's release)
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    image_token_id: int
    text_hidden: int  # the width of the rows encode_image returns

    def grid(self, height: int, width: int) -> tuple[int, int, int, int]:
        return image_grid(height, width, self.patch_size, self.downsample_ratio)

    def token_count(self, height: int, width: int) -> int:
        """The span's prompt positions for pixels ``height`` x ``width``."""
        return span_token_count(*self.grid(height, width)[2:])

    def check_pixels(self, shape: tuple[int, ...], max_patches: int) -> None:
        """Refuse pixels ``encode_image`` cannot take: not [3, H, W], H or W not a positive
        multiple of the patch, or more patches than the compiled bound."""
        p = self.patch_size
        if len(shape) != 3 or shape[0] != 3 or min(shape[1:]) < p or shape[1] % p or shape[2] % p:
            raise UsageError(f"pixels of shape {tuple(shape)}: encode_image takes float32 [3, H, W] with H and W "
                             f"positive multiples of the patch size {p}")
        patches = (shape[1] // p) * (shape[2] // p)
        if patches > max_patches:
            raise UsageError(f"pixels of shape {tuple(shape)} are {patches} patches; this artifact's encode_image "
                             f"takes at most {max_patches}")

    def to_manifest(self) -> dict[str, Any]:
        d = asdict(self)
        d["image_mean"], d["image_std"] = list(self.image_mean), list(self.image_std)
        return d

    @classmethod
    def from_manifest(cls, d: dict[str, Any]) -> "VisionGeometry":
        try:
            values = {f.name: d[f.name] for f in fields(cls)}
            values["image_mean"], values["image_std"] = tuple(values["image_mean"]), tuple(values["image_std"])
            return cls(**values)
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"manifest 'vision' is malformed ({e.__class__.__name__}: {e}); recompile") from None


@dataclass(frozen=True)
class VisionTower:
    """The ViT's and the aligner's widths (``vision_config``), and the compiled bound on patches."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    rope_theta: float
    max_patches: int  # encode_image's memory bound: the patches of the largest span
    norm_eps: float = 1e-6  # the release's RMSNorm eps; the config has no field for it

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rope_pairs(self) -> int:
        """Frequencies per axis: each head rotates head_dim / 2 pairs, half by row, half by column."""
        return self.head_dim // 4

    def inv_freq(self) -> list[float]:
        """The 2-D rope's frequencies, theta^(-2j / (head_dim / 2)), j < head_dim / 4."""
        r = self.head_dim // 2
        return [self.rope_theta ** (-(2 * j) / r) for j in range(self.rope_pairs)]

    def to_manifest(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_manifest(cls, d: dict[str, Any]) -> "VisionTower":
        try:
            return cls(**{f.name: d[f.name] for f in fields(cls)})
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"manifest 'vision.tower' is malformed ({e.__class__.__name__}: {e}); "
                                "recompile") from None


def max_span_patches(geometry: VisionGeometry) -> int:
    """The most ViT patches an image whose span fits ``max_image_tokens`` can cover: a grid of
    a x b tokens takes a (b + 1) + 2 positions, so one row of max_image_tokens - 3 holds the
    most tokens, each ratio² patches."""
    return max(1, geometry.max_image_tokens - 3) * geometry.downsample_ratio ** 2


def vision_tensors(geometry: VisionGeometry, tower: VisionTower) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Every tensor of the tower, the aligner and the span markers by the release's name: (its
    shape, whether ``encode_image`` multiplies by it). Linear weights are [out, in]."""
    d, p, r, t = tower.hidden_size, geometry.patch_size, geometry.downsample_ratio, geometry.text_hidden
    out = {"vision.patch_embed.proj.weight": ((d, 3 * p * p), True), "vision.patch_embed.proj.bias": ((d,), False)}
    for i in range(tower.num_layers):
        b = f"vision.blocks.{i}."
        out.update({b + "norm1.weight": ((d,), False),
                    b + "attn.wqkv.weight": ((3 * d, d), True), b + "attn.wqkv.bias": ((3 * d,), False),
                    b + "attn.wo.weight": ((d, d), True), b + "attn.wo.bias": ((d,), False),
                    b + "norm2.weight": ((d,), False),
                    b + "mlp.w1.weight": ((2 * tower.intermediate_size, d), True),
                    b + "mlp.w2.weight": ((d, tower.intermediate_size), True)})
    out.update({"vision.norm.weight": ((d,), False),
                "aligner.w1.weight": ((t, d * r * r), True), "aligner.w1.bias": ((t,), False),
                "aligner.w2.weight": ((t, t), True), "aligner.w2.bias": ((t,), False),
                "image_start": ((t,), False), "image_newline": ((t,), False), "image_end": ((t,), False)})
    return out


ENCODE_IMAGE = "encode_image"  # the library's function (docs/vision.md)


def vision_manifest(geometry: VisionGeometry, tower: VisionTower) -> dict[str, Any]:
    """The manifest's ``"vision"``: the geometry's keys, the tower under ``"tower"`` and the
    library function that runs it under ``"function"``."""
    return {**geometry.to_manifest(), "tower": tower.to_manifest(), "function": ENCODE_IMAGE}


def read_vision_manifest(d: Any) -> tuple[VisionGeometry, VisionTower, str]:
    """(geometry, tower, function name) of a manifest's ``"vision"``."""
    if not isinstance(d, dict) or not isinstance(d.get("tower"), dict) or not isinstance(d.get("function"), str):
        raise ArtifactError("manifest 'vision' is missing its 'tower' or 'function'; recompile")
    return VisionGeometry.from_manifest(d), VisionTower.from_manifest(d["tower"]), d["function"]

