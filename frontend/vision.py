"""DeepSeek-V4.1's vision tower as the release ships it (docs/vision.md): ``vision_config`` and
``image_token_id`` beside ``text_config`` in ``config.json``, and the tensors ``vision.*``,
``aligner.*`` and ``image_start`` / ``image_end`` / ``image_newline`` (BF16 in the release).

The tower is not part of the text model's IR: ``dsv4c compile`` builds it into the artifact as
its own function ``encode_image`` (``codegen.relax_vision``) when the config has a vision tower.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from dsv4c.artifact.model_config import ModelConfig
from dsv4c.artifact.rows import RowSource
from dsv4c.artifact.vision import (RELEASE_IMAGE_MEAN, RELEASE_IMAGE_STD, VisionGeometry, VisionTower,
                                   max_span_patches, vision_tensors)
from dsv4c.errors import ConfigError
from dsv4c.frontend.tensor_inventory import DENSE, FP32, TensorSpec

# vision_config's fields as the release's config class declares them, with its defaults.
_DEFAULTS = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 32, "num_attention_heads": 16,
             "patch_size": 14, "downsample_ratio": 3, "rope_theta": 10000.0, "max_image_tokens": 1024,
             "min_pixels": 295936, "max_wh_ratio": None}
_IGNORED = {"model_type", "torch_dtype", "dtype", "transformers_version", "architectures"}
RELEASE_IMAGE_TOKEN_ID = 129264


def _positive_int(v: dict[str, Any], key: str) -> int:
    x = v[key]
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ConfigError(f"config field 'vision_config.{key}' must be an integer >= 1, got {x!r}")
    return x


def read_vision(raw: dict[str, Any], text_hidden: int) -> tuple[VisionGeometry, VisionTower] | None:
    """The vision geometry and tower of a composite V4.1 config, or None when it has no
    ``vision_config`` (a text-only model, or transformers' flat text config)."""
    section = raw.get("vision_config")
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ConfigError("config field 'vision_config' must be an object")
    unknown = sorted(set(section) - set(_DEFAULTS) - _IGNORED)
    if unknown:
        raise ConfigError(f"config field 'vision_config.{unknown[0]}' is not understood by dsv4c; refusing rather "
                          "than compiling a different tower")
    v = {**_DEFAULTS, **{k: x for k, x in section.items() if k in _DEFAULTS}}
    ints = {k: _positive_int(v, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                              "num_attention_heads", "patch_size", "downsample_ratio",
                                              "max_image_tokens", "min_pixels")}
    if ints["hidden_size"] % (4 * ints["num_attention_heads"]):
        raise ConfigError("config: vision_config.hidden_size must be a multiple of 4 x num_attention_heads "
                          "(each head's 2-D rope turns a quarter of its channels by row, a quarter by column)")
    if ints["max_image_tokens"] < 4:
        raise ConfigError("config field 'vision_config.max_image_tokens' must be at least 4 (start, one token, "
                          "its newline, end)")
    ratio = v["max_wh_ratio"]
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or ratio <= 0):
        raise ConfigError(f"config field 'vision_config.max_wh_ratio' must be a positive number or null, got {ratio!r}")
    theta = v["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 1:
        raise ConfigError(f"config field 'vision_config.rope_theta' must be a number > 1, got {theta!r}")
    token = raw.get("image_token_id", RELEASE_IMAGE_TOKEN_ID)
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise ConfigError(f"config field 'image_token_id' must be a token id, got {token!r}")
    geometry = VisionGeometry(
        patch_size=ints["patch_size"], downsample_ratio=ints["downsample_ratio"],
        max_image_tokens=ints["max_image_tokens"], min_pixels=ints["min_pixels"],
        max_wh_ratio=None if ratio is None else float(ratio), image_mean=RELEASE_IMAGE_MEAN,
        image_std=RELEASE_IMAGE_STD, image_token_id=token, text_hidden=text_hidden)
    tower = VisionTower(hidden_size=ints["hidden_size"], intermediate_size=ints["intermediate_size"],
                        num_layers=ints["num_hidden_layers"], num_heads=ints["num_attention_heads"],
                        rope_theta=float(theta), max_patches=max_span_patches(geometry))
    return geometry, tower


def raw_config(model: str | Path) -> dict[str, Any]:
    """The config dict of a preset name or a model directory / config file (as ``resolve_model``
    reads it), for the sections the text model's config leaves out."""
    from dsv4c.frontend.config import PRESETS

    p = Path(model)
    if str(model) in PRESETS and not p.exists():
        return json.loads(resources.files("dsv4c.frontend").joinpath(f"presets/{model}.json").read_text())
    if p.is_dir():
        p = next((c for c in (p / "config.json", p / "inference" / "config.json") if c.is_file()), p / "config.json")
    return json.loads(p.read_text())


def model_vision(model: str | Path, cfg: ModelConfig) -> tuple[VisionGeometry, VisionTower] | None:
    """The vision tower of model ``model`` (already resolved to ``cfg``), None without one."""
    if cfg.family != "v4.1":
        return None
    return read_vision(raw_config(model), cfg.hidden_size)


def vision_sources(ckpt, geometry: VisionGeometry, tower: VisionTower) -> dict[str, RowSource]:
    """The tower's checkpoint tensors as row sources, each checked (float storage, the shape
    the config implies) from the headers before anything is read."""
    return {name: ckpt.source(TensorSpec(name, shape, DENSE if multiplied else FP32))
            for name, (shape, multiplied) in vision_tensors(geometry, tower).items()}
