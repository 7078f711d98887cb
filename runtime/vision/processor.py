"""DeepSeek-V4.1's image processor (the release's ``inference/image_processor.py``, written by us
from its rules): a picture becomes the normalized pixel array the artifact's ``encode_image``
takes and the number of prompt positions its span fills.

The rules (``geometry``: the artifact's :class:`~dsv4c.artifact.vision.VisionGeometry`): the
target size is the picture's, its width capped at ``max_wh_ratio`` times its height when the
model has such a cap, scaled up to at least ``min_pixels`` pixels; each side rounds up to a
multiple of the patch size. Every ``downsample_ratio`` x ``downsample_ratio`` patches are one
image token, and the span is ``image_start``, each row of tokens followed by ``image_newline``,
``image_end``. A span over ``max_image_tokens`` shrinks the target to the largest grid of whole
cells (a cell: the pixels of one token) within the budget. The picture is resized once, keeping
its aspect ratio, to fit the target and centred on grey (Pillow's ``ImageOps.pad``, bicubic);
pixels are scaled to [0, 1], normalized by ``image_mean`` / ``image_std`` and laid out
``[3, height, width]`` in float32.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from dsv4c.artifact.vision import VisionGeometry
from dsv4c.runtime.vision.intake import to_rgb

PAD_COLOR = (127, 127, 127)


@dataclass(frozen=True)
class ProcessedImage:
    pixels: np.ndarray  # float32 [3, height, width], normalized; height and width multiples of the patch size
    token_count: int  # the prompt positions the image's span fills
    digest: str  # sha256 of the pixels' shape and bytes: the same picture, the same digest


def target_size(width: int, height: int, geometry: VisionGeometry) -> tuple[int, int]:
    """The pixel size (width, height) a ``width`` x ``height`` picture is padded into."""
    patch, ratio, budget = geometry.patch_size, geometry.downsample_ratio, geometry.max_image_tokens
    w, h = width, height
    if geometry.max_wh_ratio is not None and w > h * geometry.max_wh_ratio:
        w = h * geometry.max_wh_ratio
    if w * h < geometry.min_pixels:
        scale = math.sqrt(geometry.min_pixels / (w * h))
        w, h = int(w * scale), int(h * scale)
    best_w, best_h = math.ceil(w / patch) * patch, math.ceil(h / patch) * patch
    if geometry.token_count(best_h, best_w) <= budget:
        return best_w, best_h
    # The largest grid of whole cells whose span fits: columns c and rows c * h / w solve
    # rows * (c + 1) + 2 = budget (the 2: image_start and image_end); a sliver too thin for one
    # cell across gets one cell and the rest along it.
    aspect, cell = h / w, patch * ratio
    max_w = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    max_h = max_w * aspect
    if max_w < 1:
        return cell, (budget - 2) // 2 * cell
    if max_h < 1:
        return (budget - 3) * cell, cell
    scale = min(math.floor(max_w) * cell / w, math.floor(max_h) * cell / h)
    return math.floor(w * scale / patch) * patch, math.floor(h * scale / patch) * patch


def preprocess(image: Image.Image, geometry: VisionGeometry) -> ProcessedImage:
    """``image`` (any mode; the server's intake has applied its EXIF orientation) as the pixels
    ``encode_image`` takes, the positions its span fills, and its digest."""
    image = to_rgb(image)
    size = target_size(*image.size, geometry)
    padded = ImageOps.pad(image, size, method=Image.Resampling.BICUBIC, color=PAD_COLOR)
    pixels = np.asarray(padded, dtype=np.float32).transpose(2, 0, 1) / np.float32(255)
    mean = np.asarray(geometry.image_mean, dtype=np.float32).reshape(3, 1, 1)
    std = np.asarray(geometry.image_std, dtype=np.float32).reshape(3, 1, 1)
    pixels = np.ascontiguousarray((pixels - mean) / std, dtype=np.float32)
    digest = hashlib.sha256(repr(pixels.shape).encode() + pixels.tobytes()).hexdigest()
    return ProcessedImage(pixels, geometry.token_count(*pixels.shape[1:]), digest)


def expand_image_placeholders(token_ids: list[int], images: list[ProcessedImage],
                              image_token_id: int) -> tuple[list[int], list[int]]:
    """The prompt with its ``i``-th ``image_token_id`` (the ``<｜deepseek_image｜>`` the encoder
    wrote for the ``i``-th image) repeated ``images[i].token_count`` times, and where each image's
    span starts in it."""
    places = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(places) != len(images):
        raise ValueError(f"the prompt holds {len(places)} image placeholders for {len(images)} images")
    expanded, starts, done = [], [], 0
    for place, image in zip(places, images):
        expanded += token_ids[done:place]
        starts.append(len(expanded))
        expanded += [image_token_id] * image.token_count
        done = place + 1
    return expanded + token_ids[done:], starts
