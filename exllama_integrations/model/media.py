"""Images from callers: read as bytes (data URLs, base64, files, opt-in http(s)), decoded with Pillow, bounded.

Everything here is untrusted input. An image is refused with a typed :class:`~exllama_integrations.errors.MediaError`
(400 on the server) when it is too many bytes, claims too many pixels (checked from its header, before a pixel is
decoded), is truncated, is not an image of a format taken, or is declared as something that is not an image. A
request has one budget besides (all its images' bytes, the pixels they claim, the time their decoding takes),
checked from the headers before any image is decoded, so a decompression bomb, or sixteen of them, costs nothing.
Each image is decoded straight to at most ``decode_pixels`` (JPEG's decoder scales while it reads; other formats are
reduced right after), so what a request holds, and what travels to an engine, is bounded by the size the model's
processor takes, not by the size the client sent; EXIF orientation is applied, as transformers' ``load_image`` does.

A URL is fetched only where the caller allows it, and only as :mod:`.fetch` says is safe.

Example:
    >>> m = media_from_data_url("data:text/plain;base64,aGk=", MediaLimits())
    Traceback (most recent call last):
    ...
    exllama_integrations.errors.MediaError: a data URL of type 'text/plain' is not an image; send image/png, \
image/jpeg, image/webp, image/gif or image/bmp.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..contract.api import Media
from ..errors import MediaError
from .fetch import REFUSED_FETCH, fetch_image, over_total

if TYPE_CHECKING:
    from PIL.Image import Image

logger = logging.getLogger(__name__)

MIB = 1024 * 1024
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif", "BMP": "image/bmp"}
"""Image formats taken (Pillow's names) and their MIME types."""


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on the images of one request."""

    max_bytes: int = 20 * MIB
    """Largest encoded image."""
    max_pixels: int = 40_000_000
    """Most pixels one image may claim (width x height), checked before decoding."""
    max_images: int = 16
    """Most images in one request."""
    max_total_bytes: int = 64 * MIB
    """Most encoded bytes of all of a request's images together."""
    max_total_pixels: int = 200_000_000
    """Most pixels all of a request's images may claim together (sixteen 12-Mpixel photos), checked before decoding."""
    decode_pixels: int = 4_194_304
    """Most pixels an image is decoded to (2048 x 2048; larger ones are scaled down, aspect kept): more than the
    vision processors we serve read (Gemma 3: 896 x 896; Pixtral: 1024 x 1024), so a request's decoded images
    stay under ``max_images * decode_pixels * 3`` bytes."""
    decode_timeout: float = 30.0
    """Seconds the decoding of a request's images may take in all (checked between images)."""
    fetch_urls: bool = False
    """Whether http(s) URLs are fetched (in process: yes by default, see :func:`in_process_limits`; served: only
    when the operator allows it)."""
    fetch_timeout: float = 10.0
    """Seconds a fetch may take in all (connect, headers and body, however slowly they come)."""
    fetch_allow: tuple[str, ...] = ()
    """Hosts, addresses and networks (``"images.internal"``, ``"10.0.0.0/8"``) a fetch may reach although they
    are not global (loopback, private, link-local ...); ``"*"`` allows every address (the in-process default)."""
    fetch_reasons: bool = False
    """Whether a refused fetch says why (in process: yes; served: no, the reasons would map the server's network)."""
    tally: Tally | None = field(default=None, compare=False)
    """The bytes of one request's images read so far (:meth:`for_request`): checked against ``max_total_bytes`` as
    each image is read and while a URL is fetched, so a request cannot hold more than its total however many images
    it names (None: each image alone, the total checked when they are opened)."""

    def for_request(self) -> MediaLimits:
        """These limits for one request, with a tally of its own."""
        return replace(self, tally=Tally())


class Tally:
    """Bytes of images one request has read so far (see :attr:`MediaLimits.tally`)."""

    def __init__(self) -> None:
        self.spent = 0
        self._lock = threading.Lock()

    def charge(self, n: int, limit: int) -> None:
        """Count ``n`` more bytes; refuse when the request's images would hold more than ``limit``.

        Raises:
            MediaError: naming the limit.
        """
        with self._lock:
            if self.spent + n > limit:
                raise MediaError(over_total(self.spent + n, limit))
            self.spent += n

    def left(self, limit: int) -> int:
        """Bytes the request's images may still hold."""
        return max(0, limit - self.spent)


def in_process_limits() -> MediaLimits:
    """The limits for the in-process adapters: the caller is the user, so their URLs are fetched from anywhere.

    A refused fetch says why, too.
    """
    return MediaLimits(fetch_urls=True, fetch_allow=("*",), fetch_reasons=True)


def check_image_count(n: int, limits: MediaLimits) -> None:
    """Refuse a request with more than ``max_images`` images (call it before fetching or decoding any).

    Raises:
        MediaError: naming the limit.
    """
    if n > limits.max_images:
        raise MediaError(f"a request may carry at most {limits.max_images} images; it has {n}.")


def _check_mime(mime: str | None, where: str) -> None:
    if mime and not mime.lower().startswith("image/"):
        taken = ", ".join(FORMATS.values())
        taken = taken.rsplit(", ", 1)[0] + " or " + taken.rsplit(", ", 1)[1]
        raise MediaError(f"{where} of type {mime!r} is not an image; send {taken}.")


def media_from_bytes(data: bytes, mime: str | None, limits: MediaLimits) -> Media:
    """An image given as bytes, checked for size (and its declared type)."""
    _check_mime(mime, "an image")
    if len(data) > limits.max_bytes:
        raise MediaError(
            f"an image of {len(data)} bytes is larger than this server takes ({limits.max_bytes} bytes); "
            "send a smaller or more compressed image."
        )
    if not data:
        raise MediaError("an image is empty (0 bytes).")
    if limits.tally is not None:
        limits.tally.charge(len(data), limits.max_total_bytes)
    return Media(data, mime)


def media_from_base64(text: str, mime: str | None, limits: MediaLimits) -> Media:
    """An image given as base64 text."""
    _check_mime(mime, "an image")
    if len(text) > limits.max_bytes * 4 // 3 + 8:
        raise MediaError(f"a base64 image is larger than {limits.max_bytes} bytes; send a smaller image.")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("an image's base64 data is not valid base64.") from None
    return media_from_bytes(data, mime, limits)


def media_from_data_url(url: str, limits: MediaLimits) -> Media:
    """An image given as a ``data:image/...;base64,...`` URL."""
    head, sep, payload = url.partition(",")
    if not sep or not head.startswith("data:"):
        raise MediaError("a data URL must look like data:image/png;base64,<data>.")
    meta = head[5:].split(";")
    mime = meta[0] or None
    _check_mime(mime or "text/plain", "a data URL")
    if "base64" not in meta[1:]:
        raise MediaError("an image data URL must be base64 (data:image/png;base64,<data>).")
    return media_from_base64(payload, mime, limits)


def media_from_path(path: str | Path, mime: str | None, limits: MediaLimits) -> Media:
    """An image read from a local file (a regular file, at most ``max_bytes``)."""
    import os
    import stat

    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise MediaError(f"cannot read the image file {str(p)!r}: {e.strerror}.") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise MediaError(f"the image path {str(p)!r} is not a regular file.")
        data = f.read(limits.max_bytes + 1)
    return media_from_bytes(data, mime, limits)


def media_from_url(url: str, limits: MediaLimits, mime: str | None = None) -> Media:
    """An image from a ``data:`` URL, or from an http(s) URL where ``limits.fetch_urls`` allows fetching."""
    if url.startswith("data:"):
        return media_from_data_url(url, limits)
    scheme = url.split(":", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise MediaError(f"an image URL must be data:, http: or https:, not {scheme + ':'!r}.")
    if not limits.fetch_urls:
        raise MediaError(
            "image URLs are not fetched here; send the image as a data: URL (data:image/png;base64,...), "
            "or start the server with --allow-image-urls."
        )
    return media_from_bytes(fetch_image(url, limits), mime, limits)  # charged to the request's tally there


def image_key(media: Media) -> str:
    """A stable key for an image's bytes (the embedding cache's key)."""
    return hashlib.sha256(media.data).hexdigest()


_EXIF_TURN = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
              7: "TRANSVERSE", 8: "ROTATE_90"}  # fmt: skip
"""EXIF orientation -> the turn that shows the image upright (Pillow's ``ImageOps.exif_transpose`` table)."""


def open_images(media: tuple[Media, ...] | list[Media], limits: MediaLimits | None = None) -> list[Image]:
    """Decode images with Pillow within the request's budget; RGB images of at most ``decode_pixels``, upright.

    Every image's bytes, format and claimed size are checked first (from its header), the request's totals
    next, and only then is anything decoded: each straight to at most ``decode_pixels`` (see the module docstring).

    Raises:
        MediaError: too many images, too many bytes or pixels (one image's or the request's), decoding past
            ``decode_timeout``, truncated or not an image of a format taken.
    """
    try:
        from PIL import Image as PILImage
    except ImportError:
        raise MediaError(
            "reading images needs Pillow: pip install 'exllama-integrations[vision]' (or pillow)."
        ) from None
    limits = limits or MediaLimits()
    check_image_count(len(media), limits)
    total = sum(len(m.data) for m in media)
    if total > limits.max_total_bytes:
        raise MediaError(
            f"a request's images hold {total} bytes, more than the {limits.max_total_bytes} taken in one request; "
            "send fewer or smaller images."
        )
    opened: list[Any] = []
    try:
        for n, m in enumerate(media, 1):
            media_from_bytes(m.data, m.mime, limits)  # its size and declared type, before Pillow reads it
            with _readable(n):
                img = PILImage.open(io.BytesIO(m.data), formats=list(FORMATS))
            opened.append(img)
            w, h = img.size
            if w < 1 or h < 1 or w * h > limits.max_pixels:
                raise MediaError(
                    f"image {n} claims {w} x {h} pixels, more than the {limits.max_pixels} taken; send a smaller image."
                )
        claimed = sum(img.size[0] * img.size[1] for img in opened)
        if claimed > limits.max_total_pixels:
            raise MediaError(
                f"a request's images claim {claimed} pixels, more than the {limits.max_total_pixels} taken in one "
                "request; send fewer or smaller images."
            )
        deadline = time.monotonic() + limits.decode_timeout
        out = []
        for n, img in enumerate(opened, 1):
            if time.monotonic() > deadline:
                raise MediaError(
                    f"decoding this request's images took over {limits.decode_timeout:g} s (at image {n}); send "
                    "fewer or smaller images."
                )
            with _readable(n):
                out.append(_decode(PILImage, img, limits.decode_pixels))
            img.close()  # its full-size pixels go now, not after the last image
            opened[n - 1] = None
        return out
    finally:
        for each in opened:
            if each is not None:
                each.close()


def _readable(n: int) -> Any:
    """A block in which Pillow's failures to read image ``n`` become a MediaError."""
    import contextlib

    from PIL import Image as PILImage

    @contextlib.contextmanager
    def block() -> Any:
        try:
            yield
        except MediaError:
            raise
        except PILImage.DecompressionBombError:
            raise MediaError(f"image {n} claims too many pixels to decode; send a smaller image.") from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise MediaError(
                f"image {n} could not be read ({type(e).__name__}: {str(e)[:120]}); send a PNG, JPEG, WebP, GIF "
                "or BMP file."
            ) from None

    return block()


def _decode(pil: Any, img: Any, most: int) -> Image:
    """One opened image as RGB of at most ``most`` pixels (aspect kept), its first frame, EXIF orientation applied."""
    w, h = img.size
    scale = min(1.0, (most / (w * h)) ** 0.5)
    size = (max(1, int(w * scale)), max(1, int(h * scale)))
    turn = _EXIF_TURN.get(img.getexif().get(0x0112, 1))
    img.seek(0)  # the first frame of an animation
    if scale < 1.0 and img.format == "JPEG":
        img.draft("RGB", size)  # the decoder scales by 1/2, 1/4 or 1/8 as it reads: never the full size in memory
    img.load()  # decodes: a truncated file fails here
    if scale < 1.0 and img.mode not in ("RGB", "RGBA", "L"):
        img = img.convert("RGB")  # palette and other modes cannot be reduced as they are
    if scale < 1.0:
        factor = min(img.size[0] // size[0], img.size[1] // size[1])
        if factor > 1:
            img = img.reduce(factor)  # a cheap box reduction first, then the exact size
        if img.size != size:
            img = img.resize(size, pil.Resampling.BICUBIC, reducing_gap=None)
    rgb = img.convert("RGB")
    if turn is not None:
        rgb = rgb.transpose(getattr(pil.Transpose, turn))
    return rgb  # type: ignore[no-any-return]


__all__ = [
    "FORMATS",
    "REFUSED_FETCH",
    "check_image_count",
    "MediaLimits",
    "image_key",
    "in_process_limits",
    "media_from_base64",
    "media_from_bytes",
    "media_from_data_url",
    "media_from_path",
    "media_from_url",
    "open_images",
]
