"""Images from callers: read as bytes (data URLs, base64, files, opt-in http(s)), decoded with Pillow, bounded.

Everything here is untrusted input. An image is refused with a typed :class:`~exllama_integrations.errors.MediaError`
(400 on the server) when it is too many bytes, claims too many pixels (checked from its header, before a pixel is
decoded, so a decompression bomb costs nothing), is truncated, is not an image of a format taken, or is declared
as something that is not an image. A URL is fetched only where the caller allows it, with a size cap, a time
limit and no redirects (a redirect could lead anywhere, e.g. to a ``file:`` or an internal address).

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
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..contract.api import Media
from ..errors import MediaError

if TYPE_CHECKING:
    from PIL.Image import Image

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
    fetch_urls: bool = False
    """Whether http(s) URLs are fetched (in process: yes by default, see :func:`in_process_limits`; served: only
    when the operator allows it)."""
    fetch_timeout: float = 10.0
    """Seconds a fetch may take in all (connect, headers and body)."""


def in_process_limits() -> MediaLimits:
    """The limits for the in-process adapters: the caller is the user, so URLs they give are fetched."""
    return MediaLimits(fetch_urls=True)


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
    return media_from_bytes(_fetch(url, limits), mime, limits)


def _fetch(url: str, limits: MediaLimits) -> bytes:
    import urllib.error
    import urllib.request

    class _NoRedirect(urllib.request.HTTPRedirectHandler):
        def http_error_302(self, *args: Any) -> None:
            raise MediaError("the image URL redirects; redirects are not followed (give the final URL).")

        http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302  # type: ignore[assignment]

    opener = urllib.request.build_opener(_NoRedirect)
    deadline = time.monotonic() + limits.fetch_timeout
    try:
        with opener.open(urllib.request.Request(url, method="GET"), timeout=limits.fetch_timeout) as resp:
            _check_mime(resp.headers.get_content_type(), "the image URL's content")
            chunks, size = [], 0
            while size <= limits.max_bytes:
                if time.monotonic() > deadline:
                    raise MediaError(f"fetching the image took longer than {limits.fetch_timeout} s.")
                chunk = resp.read(64 * 1024)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            return b"".join(chunks)
    except MediaError:
        raise
    except urllib.error.HTTPError as e:
        raise MediaError(f"fetching the image failed: HTTP {e.code}.") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise MediaError(f"fetching the image failed: {getattr(e, 'reason', e)}.") from None


def image_key(media: Media) -> str:
    """A stable key for an image's bytes (the embedding cache's key)."""
    return hashlib.sha256(media.data).hexdigest()


def open_images(media: tuple[Media, ...] | list[Media], limits: MediaLimits | None = None) -> list[Image]:
    """Decode images with Pillow, each checked against ``limits`` before its pixels are decoded; RGB images.

    Raises:
        MediaError: too many images, too many bytes or pixels, truncated or not an image of a format taken.
    """
    try:
        from PIL import Image as PILImage
    except ImportError:
        raise MediaError(
            "reading images needs Pillow: pip install 'exllama-integrations[vision]' (or pillow)."
        ) from None
    limits = limits or MediaLimits()
    if len(media) > limits.max_images:
        raise MediaError(f"a request may carry at most {limits.max_images} images; it has {len(media)}.")
    out = []
    for n, m in enumerate(media, 1):
        media_from_bytes(m.data, m.mime, limits)  # its size and declared type, before Pillow reads it
        try:
            with PILImage.open(io.BytesIO(m.data), formats=list(FORMATS)) as img:
                w, h = img.size
                if w < 1 or h < 1 or w * h > limits.max_pixels:
                    raise MediaError(
                        f"image {n} claims {w} x {h} pixels, more than the {limits.max_pixels} taken; "
                        "send a smaller image."
                    )
                img.seek(0)  # the first frame of an animation
                rgb = img.convert("RGB")  # decodes: a truncated file fails here
        except MediaError:
            raise
        except PILImage.DecompressionBombError:
            raise MediaError(f"image {n} claims too many pixels to decode; send a smaller image.") from None
        except (OSError, SyntaxError, ValueError, EOFError) as e:
            raise MediaError(
                f"image {n} could not be read ({type(e).__name__}: {str(e)[:120]}); send a PNG, JPEG, WebP, GIF "
                "or BMP file."
            ) from None
        out.append(rgb)
    return out


__all__ = [
    "FORMATS",
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
