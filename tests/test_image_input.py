"""Images on the user's side (docs/vision_serving.md): where an image part's URL may point, every
bad image refused with its error code before anything is decoded that need not be, the modes
converted as the release converts them, and the processor's pixels and token counts against the
release's image processor re-derived here from its rules (its sizing written anew, Pillow's
``ImageOps.pad`` and the normalization as the release calls them) on odd sizes and modes."""

import base64
import io
import math
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from dsv4c.artifact.vision import VisionGeometry
from dsv4c.errors import UsageError
from dsv4c.runtime.serve.openapi import Bounds, request_body
from dsv4c.runtime.serve.protocol import CHAT, APIError, chat_request, image_urls
from dsv4c.runtime.vision.intake import ImageError, ImageIntake, decode_image
from dsv4c.runtime.vision.processor import expand_image_placeholders, preprocess

IMAGE_TOKEN = 7


def geometry(**changes) -> VisionGeometry:
    """The release's image geometry (VISION.md's table: patch 14, 3 x 3 patches a token, 1024
    positions at most, 544² pixels at least, no aspect cap, mean = std = 0.5)."""
    release = dict(patch_size=14, downsample_ratio=3, max_image_tokens=1024, min_pixels=544 * 544, max_wh_ratio=None,
                   image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5), image_token_id=IMAGE_TOKEN, text_hidden=16)
    return VisionGeometry(**{**release, **changes})


def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def noise(size: tuple[int, int], mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1, "LA": 2, "CMYK": 4}[mode]
    values = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], channels), dtype=np.uint8)
    return Image.fromarray(values[..., 0] if channels == 1 else values, mode)


# --------------------------------------------------------------------------- the reference processor

def reference_target(width: int, height: int, g) -> tuple[int, int]:
    """The release's sizing, written from its rules: upscale to the minimum area, round up to
    patches, and over the token budget take the largest whole-cell grid that fits."""
    p, r, budget = g.patch_size, g.downsample_ratio, g.max_image_tokens
    if g.max_wh_ratio is not None and width > height * g.max_wh_ratio:
        width = height * g.max_wh_ratio
    if width * height < g.min_pixels:
        s = math.sqrt(g.min_pixels / (width * height))
        width, height = int(width * s), int(height * s)
    w, h = -(-width // p) * p, -(-height // p) * p

    def tokens(w, h):
        rows, cols = -(-(h // p) // r), -(-(w // p) // r)
        return rows * cols + rows + 2

    if tokens(w, h) <= budget:
        return w, h
    # The real column count c whose grid (c * aspect rows, a newline each, start and end) fills
    # the budget: aspect * c * (c + 1) + 2 = budget.
    aspect, cell = height / width, p * r
    c = math.sqrt((budget - 2) / aspect + 0.25) - 0.5
    if c < 1 or c * aspect < 1:  # not one whole cell across (or down): one cell, the rest of the budget along
        across = c < 1
        along = ((budget - 2) // 2 if across else budget - 3) * cell
        return (cell, along) if across else (along, cell)
    s = min(math.floor(c) * cell / width, math.floor(c * aspect) * cell / height)
    return tuple(math.floor(side * s / p) * p for side in (width, height))


def reference_pixels(raw: bytes, g) -> np.ndarray:
    """What the release's processor makes of an image file: upright, ``convert("RGB")``, padded
    on grey 127 with ``ImageOps.pad``, scaled to [0, 1] and normalized, channels first."""
    image = ImageOps.exif_transpose(Image.open(io.BytesIO(raw))).convert("RGB")
    padded = ImageOps.pad(image, reference_target(*image.size, g), color=(127, 127, 127))
    x = np.array(padded, dtype=np.float32).transpose(2, 0, 1) / np.float32(255.0)
    mean, std = (np.array(v, np.float32)[:, None, None] for v in (g.image_mean, g.image_std))
    return (x - mean) / std


def exif_rotated() -> bytes:
    """A 40 x 24 JPEG whose EXIF says: turn me 90 degrees clockwise to view (orientation 6)."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encoded(noise((40, 24), seed=3), "JPEG", exif=exif.tobytes())


PARITY_IMAGES = {
    "1x1": lambda: encoded(Image.new("RGB", (1, 1), (200, 10, 30))),
    "1x5000": lambda: encoded(noise((1, 5000), seed=1)),  # too thin for one cell across
    "5000x1": lambda: encoded(noise((5000, 1), seed=2)),
    "20000x1": lambda: encoded(noise((20000, 1), seed=12)),  # too flat for one cell down
    "grayscale": lambda: encoded(noise((333, 217), "L", seed=4)),
    "rgba": lambda: encoded(noise((97, 61), "RGBA", seed=5)),  # the alpha channel is dropped
    "la": lambda: encoded(noise((30, 70), "LA", seed=6)),
    "palette": lambda: encoded(noise((123, 77), seed=7).convert("P", palette=Image.Palette.ADAPTIVE)),
    "exif-rotated": exif_rotated,
    "cmyk-jpeg": lambda: encoded(noise((50, 40), "CMYK", seed=8), "JPEG"),
    "over-budget": lambda: encoded(noise((1600, 1200), seed=9), "JPEG"),  # shrunk to the 1024-token budget
    "square-544": lambda: encoded(noise((544, 544), seed=10)),
}


@pytest.mark.parametrize("name", sorted(PARITY_IMAGES))
def test_pixels_and_token_counts_equal_the_release_processors(name):
    raw, g = PARITY_IMAGES[name](), geometry()
    ours = preprocess(decode_image(io.BytesIO(raw), 10**8), g)
    want = reference_pixels(raw, g)
    assert ours.pixels.dtype == np.float32 and ours.pixels.flags.c_contiguous
    assert ours.pixels.shape == want.shape and np.array_equal(ours.pixels, want), name
    _, h, w = want.shape
    rows, cols = math.ceil(h / 14 / 3), math.ceil(w / 14 / 3)
    assert ours.token_count == rows * (cols + 1) + 2 <= g.max_image_tokens


def test_known_sizes_of_the_release():
    g = geometry()
    assert reference_target(544, 544, g) == (546, 546)  # 13 x 13 tokens: 13 * 14 + 2 = 184 positions
    assert preprocess(Image.new("RGB", (544, 544)), g).token_count == 184
    assert preprocess(Image.new("RGB", (1, 5000)), g).pixels.shape == (3, 511 * 42, 42)
    assert preprocess(Image.new("RGB", (5000, 1)), g).token_count == 919  # under the budget once upscaled
    assert preprocess(Image.new("RGB", (20000, 1)), g).pixels.shape == (3, 42, 1021 * 42)


@pytest.mark.parametrize("size", [(300, 20), (20, 300), (500, 450), (7, 7)])
@pytest.mark.parametrize("changes", [dict(max_wh_ratio=8), dict(max_image_tokens=64, min_pixels=100),
                                     dict(patch_size=16, downsample_ratio=2, image_mean=(0.4, 0.5, 0.6),
                                          image_std=(0.2, 0.3, 0.25))])
def test_other_geometries_follow_the_same_rules(size, changes):
    g, raw = geometry(**changes), encoded(noise(size, seed=11))
    ours = preprocess(decode_image(io.BytesIO(raw), 10**8), g)
    assert np.array_equal(ours.pixels, reference_pixels(raw, g))
    assert ours.token_count <= g.max_image_tokens


def test_the_digest_names_the_pixels():
    g = geometry()
    a, b = noise((64, 48), seed=1), noise((64, 48), seed=2)
    assert preprocess(a, g).digest == preprocess(a.copy(), g).digest != preprocess(b, g).digest
    # The same picture sent as PNG and as (lossless) WEBP is the same image to the prefix cache.
    png, webp = (decode_image(io.BytesIO(encoded(a, fmt, **options)), 10**8)
                 for fmt, options in (("PNG", {}), ("WEBP", {"lossless": True})))
    assert preprocess(png, g).digest == preprocess(webp, g).digest


def test_placeholders_expand_to_each_images_span():
    g = geometry()
    small, large = preprocess(Image.new("RGB", (10, 10)), g), preprocess(Image.new("RGB", (1100, 600)), g)
    ids, starts = expand_image_placeholders([1, IMAGE_TOKEN, 2, 3, IMAGE_TOKEN, 4], [small, large], IMAGE_TOKEN)
    assert starts == [1, 1 + small.token_count + 2]
    assert ids == [1, *[IMAGE_TOKEN] * small.token_count, 2, 3, *[IMAGE_TOKEN] * large.token_count, 4]
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        expand_image_placeholders([IMAGE_TOKEN, IMAGE_TOKEN], [small], IMAGE_TOKEN)


# --------------------------------------------------------------------------- decoding and bad images

def _png(width: int, height: int, idat: bytes = b"") -> bytes:
    """A PNG of just a header saying ``width`` x ``height`` and the given pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _animated_gif() -> bytes:
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    return encoded(frames[0], "GIF", save_all=True, append_images=frames[1:])


BAD_IMAGES = {
    "not an image": (b"hello, world", "invalid_image_format", "not an image"),
    "truncated png": (encoded(noise((64, 64)))[:-200], "invalid_image_format", "truncated or corrupt"),
    "truncated jpeg": (encoded(noise((64, 64)), "JPEG")[:1500], "invalid_image_format", "truncated or corrupt"),
    "zero-sized": (_png(0, 16), "invalid_image_format", "a zero size"),
    # Its header says 30000 x 30000 and no pixel data follows: refused from the header alone.
    "decompression bomb": (_png(30000, 30000, zlib.compress(b"\0" * 100)), "image_too_large", "--max-image-pixels"),
    "just over the limit": (encoded(Image.new("L", (1001, 1000))), "image_too_large", "1,001,000 pixels"),
    "animated gif": (_animated_gif(), "invalid_image_format", "animated"),
    "tiff": (encoded(Image.new("RGB", (4, 4)), "TIFF"), "invalid_image_format", "PNG, JPEG, WEBP, GIF"),
    "empty": (b"", "invalid_image_format", "empty"),
}


@pytest.mark.parametrize("name", sorted(BAD_IMAGES))
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow's, before our refusal
def test_every_bad_image_is_an_image_error(name):
    raw, code, fragment = BAD_IMAGES[name]
    with pytest.raises(ImageError, match=fragment) as e:
        ImageIntake(max_pixels=1_000_000).load(data_url(raw))
    assert e.value.code == code and "\n" not in str(e.value)


def test_modes_convert_as_the_release_converts_them():
    intake = ImageIntake()
    rgba = intake.load(data_url(encoded(Image.new("RGBA", (2, 2), (200, 100, 50, 0)))))
    assert rgba.mode == "RGB" and rgba.getpixel((0, 0)) == (200, 100, 50)  # the stored colour, alpha dropped
    grey16 = Image.fromarray(np.array([[0, 257, 32896, 65535]], np.uint16))
    assert grey16.mode == "I;16"  # Pillow's convert("RGB") clips these at 255: all but the first white
    assert [intake.load(data_url(encoded(grey16))).getpixel((x, 0))[0] for x in range(4)] == [0, 1, 128, 255]
    assert intake.load(data_url(encoded(Image.new("1", (3, 3), 1)))).getpixel((1, 1)) == (255, 255, 255)
    upright = intake.load(data_url(exif_rotated(), "image/jpeg"))
    assert upright.size == (24, 40)
    still = intake.load(data_url(encoded(Image.new("RGB", (5, 3), (0, 0, 255)), "GIF"), "image/gif"))
    assert still.size == (5, 3)
    # A camera's JPEG with a second picture (MPO) is its first picture, not an animation.
    photo = encoded(Image.new("RGB", (8, 6), (200, 0, 0)), "MPO", save_all=True,
                    append_images=[Image.new("RGB", (4, 4), (0, 0, 200))])
    assert intake.load(data_url(photo, "image/jpeg")).size == (8, 6)


# --------------------------------------------------------------------------- where images come from

def test_urls_the_server_refuses():
    intake = ImageIntake()
    for url, fragment in [("https://example.com/cat.png", "are not fetched"),
                          ("http://10.0.0.1/x.png", "are not fetched"),
                          ("ftp://host/x.png", "must be a data URL"), ("cat.png", "must be a data URL"),
                          ("file:///etc/hostname", "reads no image files"),
                          ("data:text/plain;base64,aGk=", "data:image/TYPE;base64"),
                          ("data:image/png,rawbytes", "data:image/TYPE;base64"),
                          ("data:image/png;base64,@@@@", "not valid base64")]:
        with pytest.raises(ImageError, match=fragment) as e:
            intake.load(url)
        assert e.value.code == "invalid_image_url"


def test_files_only_under_the_allowed_directory(tmp_path, monkeypatch):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    outside.mkdir()
    picture = encoded(Image.new("RGB", (3, 2), (9, 8, 7)))
    (allowed / "sub" / "a b.png").write_bytes(picture)
    (outside / "secret.png").write_bytes(picture)
    (allowed / "link.png").symlink_to(outside / "secret.png")
    (allowed / "escape").symlink_to(outside)
    os.mkfifo(allowed / "fifo.png")
    intake = ImageIntake(allowed_dir=allowed)
    assert intake.load(f"file://{allowed}/sub/a%20b.png").size == (3, 2)
    assert intake.load(f"file://localhost{allowed}/sub/../sub/a%20b.png").size == (3, 2)
    for url in [f"file://{outside}/secret.png", f"file://{allowed}/../outside/secret.png", f"file://{allowed}/link.png",
                f"file://{allowed}/escape/secret.png", f"file://{allowed}/%2E%2E/outside/secret.png",
                f"file://{allowed}/../outside/nothing-here.png"]:
        with pytest.raises(ImageError, match="not under the directory"):
            intake.load(url)
    for url, fragment in [(f"file://{allowed}/fifo.png", "not a regular file"),
                          (f"file://{allowed}/sub", "not a regular"), (f"file://{allowed}/missing.png", "cannot be read"),
                          ("file://otherhost/x.png", "local path")]:
        with pytest.raises(ImageError, match=fragment):
            intake.load(url)
    # `dsv4c generate --messages`: paths relative to the messages file.
    beside = ImageIntake(allowed_dir=tmp_path, relative_to=allowed / "sub")
    assert beside.load("a b.png").size == (3, 2) and beside.load("../../outside/secret.png").size == (3, 2)
    monkeypatch.chdir(allowed)  # `--messages sub/chat.json`
    assert ImageIntake(allowed_dir=Path("/"), relative_to=Path("sub")).load("a b.png").size == (3, 2)
    with pytest.raises(UsageError, match="not a directory"):
        ImageIntake(allowed_dir=tmp_path / "nope")


def test_too_many_images():
    ImageIntake(max_images=2).check_count(2)
    with pytest.raises(ImageError, match="3 images in one request, more than allowed \\(2") as e:
        ImageIntake(max_images=2).check_count(3)
    assert e.value.code == "too_many_images"


# --------------------------------------------------------------------------- the request's shape

PNG_URL = data_url(encoded(Image.new("RGB", (2, 2))))


def test_image_parts_in_chat_requests():
    body = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "compare"}, {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "low"}},
        {"type": "image_url", "image_url": {"url": "file:///b.png"}}]}]}
    messages, _ = chat_request(body, vision=True)
    assert messages[0]["content"] == "compare"
    assert image_urls(messages) == [("messages[0].content[1]", PNG_URL), ("messages[0].content[2]", "file:///b.png")]
    with pytest.raises(APIError, match="no vision tower, so only text parts"):  # a model without one
        chat_request(body)
    for part in [{"type": "image_url"}, {"type": "image_url", "image_url": PNG_URL},
                 {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "ultra"}},
                 {"type": "image_url", "image_url": {"url": 3}}]:
        with pytest.raises(APIError, match=r"messages\[0\].content\[0\]: an image part is") as e:
            chat_request({"messages": [{"role": "user", "content": [part]}]}, vision=True)
        assert e.value.status == 400


def test_the_schema_shows_image_parts_to_a_vision_model_only():
    def part_schema(vision):
        body = request_body(CHAT, ["messages"], Bounds(100, 64, 4, vision))
        messages = body["requestBody"]["content"]["application/json"]["schema"]["properties"]["messages"]
        return messages["items"]["properties"]["content"]["anyOf"][2]["items"]

    assert part_schema(False)["properties"]["type"] == {"const": "text"}
    image = part_schema(True)["anyOf"][1]
    assert image["properties"]["type"] == {"const": "image_url"}
    assert image["properties"]["image_url"]["required"] == ["url"]
