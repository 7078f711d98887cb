"""Where a chat's images come from and how their bytes become an RGB picture.

An image part's URL is a ``data:image/...;base64,...`` URL, a ``file://`` URL (or, from
``dsv4c generate --messages``, a path relative to the messages file) of a file under the one
directory the operator allows; a remote ``http(s)://`` URL is refused: the server fetches nothing.
Decoding takes PNG, JPEG, WEBP and GIF (OpenAI's set; Pillow never tries its other plugins, some
of which run outside programs), checks the pixel count from the header before decoding a byte
of pixel data, applies the EXIF orientation and converts every mode to 8-bit RGB. Every way an
image can be wrong is an :class:`ImageError`, one line saying what: a 400 from the server, an
error line from the CLI.

Decisions (docs/vision_serving.md): an animated image (more than one frame) is refused rather
than cut to its first frame, as OpenAI's API takes only non-animated GIFs. Modes convert as the
release's image processor converts them (Pillow's ``convert("RGB")``: an alpha channel is
dropped, each pixel keeps its stored colour, as the model saw images in the release), except
16-bit grey, which is scaled to 8 bits (Pillow's conversion clips it at 255, which turns most
of such an image white).
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlsplit

import numpy as np
from PIL import Image, ImageOps

from dsv4c.errors import UsageError

ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000  # a 50-megapixel photo; its RGB pixels take 150 MB while it is resized
DEFAULT_MAX_IMAGES = 16
# Our own check refuses an image over the limit right after its header is read; Pillow's guard
# (set to the same limit in decode_image) stays as the backstop and would only repeat it as a warning.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


class ImageError(UsageError):
    """An image a request cannot use; ``code`` is the OpenAI error code the server answers with."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class ImageIntake:
    """Where images may come from, and how many and how large they may be.

    ``allowed_dir``: files (``file://`` URLs, paths) are read only from under this directory, its
    real path (symlinks and ``..`` resolved, in the URL and in the file opened); None: no files.
    ``relative_to``: a plain path (no URL scheme) is relative to this directory (``dsv4c
    generate --messages``: the messages file's); None: plain paths are refused."""

    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES
    allowed_dir: Path | None = None
    relative_to: Path | None = None

    def __post_init__(self):
        if self.max_pixels < 1 or self.max_images < 0:
            raise UsageError("--max-image-pixels must be positive and --max-images-per-request >= 0")
        if self.allowed_dir is not None:
            if not Path(self.allowed_dir).is_dir():
                raise UsageError(f"--allowed-image-dir {self.allowed_dir}: not a directory")
            object.__setattr__(self, "allowed_dir", Path(self.allowed_dir).resolve())

    def check_count(self, count: int) -> None:
        if count > self.max_images:
            raise ImageError(f"{count} images in one request, more than allowed ({self.max_images}, "
                             "--max-images-per-request)", "too_many_images")

    def load(self, url: str) -> Image.Image:
        """The image ``url`` names, decoded to RGB (an :class:`ImageError` for any problem)."""
        with self._open(url) as source:
            return decode_image(source, self.max_pixels)

    def _open(self, url: str) -> BinaryIO:
        if url.startswith("data:"):
            return io.BytesIO(_data_url_bytes(url))
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme in ("http", "https"):
            raise ImageError(f"{_shown(url)}: remote URLs are not fetched; send the image itself as a data URL "
                             "(data:image/png;base64,...)", "invalid_image_url")
        if scheme == "file":
            if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
                raise ImageError(f"{_shown(url)}: a file URL names a local path: file:///PATH", "invalid_image_url")
            return self._open_file(Path(unquote(parts.path)), url)
        if scheme or self.relative_to is None:
            raise ImageError(f"{_shown(url)}: an image URL must be a data URL (data:image/png;base64,...) or a "
                             "file:// URL under the server's --allowed-image-dir", "invalid_image_url")
        return self._open_file(Path(self.relative_to).absolute() / url, url)

    def _open_file(self, path: Path, url: str) -> BinaryIO:
        if self.allowed_dir is None:
            raise ImageError(f"{_shown(url)}: this server reads no image files (start it with "
                             "--allowed-image-dir DIR to allow those under DIR)", "invalid_image_url")
        outside = ImageError(f"{_shown(url)}: not under the directory images are read from "
                             "(--allowed-image-dir)", "invalid_image_url")
        if not path.is_absolute() or not path.resolve().is_relative_to(self.allowed_dir):
            raise outside
        try:
            # Non-blocking, so that a FIFO does not hang the request; what it is gets checked below.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise ImageError(f"{_shown(url)}: cannot be read ({e.strerror})", "invalid_image_url") from None
        try:
            # The file opened is checked too: a path component swapped for a symlink after the
            # check above would otherwise lead out of the directory.
            opened = Path(os.readlink(f"/proc/self/fd/{fd}")) if Path("/proc/self/fd").is_dir() else path.resolve()
            if not opened.is_relative_to(self.allowed_dir):
                raise outside
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ImageError(f"{_shown(url)}: not a regular file", "invalid_image_url")
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")


def _shown(url: str) -> str:
    """A URL as an error message names it (data URLs and long ones shortened)."""
    if url.startswith("data:"):
        return url[:url.find(",") + 1] + "..." if "," in url[:64] else "a data URL"
    return repr(url if len(url) <= 80 else url[:77] + "...")


def _data_url_bytes(url: str) -> bytes:
    header, comma, payload = url.partition(",")
    media, _, encoding = header[len("data:"):].rpartition(";")
    if not comma or not media.lower().startswith("image/") or encoding.lower() != "base64":
        raise ImageError(f"{_shown(url)}: a data URL must read data:image/TYPE;base64,DATA", "invalid_image_url")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{_shown(url)}: its data is not valid base64", "invalid_image_url") from None
    if not data:
        raise ImageError(f"{_shown(url)}: the image is empty", "invalid_image_format")
    return data


def decode_image(source: BinaryIO, max_pixels: int) -> Image.Image:
    """The RGB picture in ``source``: checked from its header (format, size, frames) before its
    pixels are decoded, then decoded, turned upright by its EXIF orientation and converted."""
    Image.MAX_IMAGE_PIXELS = max_pixels  # Pillow's own guard: it refuses beyond twice this in any case
    unreadable = ImageError(f"not an image in a format dsv4c reads ({', '.join(ACCEPTED_FORMATS)}), or its "
                            "header is malformed (a zero size, ...)", "invalid_image_format")
    too_large = f"more pixels than allowed ({max_pixels:,}, --max-image-pixels)"
    try:
        image = Image.open(source, formats=ACCEPTED_FORMATS)
    except Image.DecompressionBombError:
        raise ImageError(f"the image has {too_large}", "image_too_large") from None
    except Exception:  # UnidentifiedImageError, or whatever a plugin meets in a malformed header
        raise unreadable from None
    width, height = image.size  # Pillow opens no image with a side of 0
    if width * height > max_pixels:
        raise ImageError(f"the image is {width} x {height} = {width * height:,} pixels, {too_large}",
                         "image_too_large")
    try:
        # A JPEG with more pictures (MPO: cameras add previews, depth or stereo views) is a still
        # photo: its first picture is the photo.
        animated = image.format != "MPO" and getattr(image, "is_animated", False)
    except Exception:
        raise unreadable from None
    if animated:
        raise ImageError(f"the {image.format} is animated: send a still image (one frame)", "invalid_image_format")
    try:
        image.load()
        return to_rgb(ImageOps.exif_transpose(image))
    except Exception as e:  # truncated data, a corrupt stream, broken EXIF: each plugin raises its own
        raise ImageError(f"the {image.format} image cannot be decoded: truncated or corrupt ({e})",
                         "invalid_image_format") from None


def to_rgb(image: Image.Image) -> Image.Image:
    """``image`` as 8-bit RGB, as the release's processor converts it (``convert("RGB")``: grey
    and palette expanded, CMYK converted, alpha dropped), 16-bit grey scaled to 8 bits first."""
    if image.mode.startswith("I"):  # 16-bit grey ("I;16", "I;16B", or "I" as some Pillows read it)
        grey = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
        image = Image.fromarray(((grey * 255 + 32767) // 65535).astype(np.uint8), "L")
    return image if image.mode == "RGB" else image.convert("RGB")
