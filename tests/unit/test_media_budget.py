"""A request's images within one budget, decoded small and upright; image URLs fetched only where safe (issue 34).

No model: images are made here (a header can claim any size for a few bytes), and the fetch tests serve from a
local HTTP server on 127.0.0.1 that the limits' allow-list lets through where a test means it to.
"""

from __future__ import annotations

import gc
import io
import os
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from exllama_integrations.contract.api import Media
from exllama_integrations.errors import MediaError
from exllama_integrations.model.media import MediaLimits, in_process_limits, media_from_url, open_images

PIL = pytest.importorskip("PIL")
from PIL import Image, ImageDraw, ImageOps  # noqa: E402


def encoded(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims ``width`` x ``height`` (what a decompression bomb looks like to its reader)."""
    data = bytearray(encoded(Image.new("RGB", (8, 8), (200, 30, 30))))
    ihdr = struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return bytes(data)


# ------------------------------------------------------------------ the request's budget (item 1)


def test_a_request_whose_images_claim_too_many_pixels_together_is_refused_before_decoding():
    each = claiming(6300, 6300)  # inside the per-image 40 Mpixel bound, like the sixteen
    t0 = time.perf_counter()
    with pytest.raises(MediaError, match="request's images claim"):
        open_images([Media(each, "image/png")] * 16, MediaLimits())
    assert time.perf_counter() - t0 < 1.0  # nothing was decoded


def test_a_request_whose_images_hold_too_many_bytes_together_is_refused():
    img = encoded(Image.effect_noise((300, 300), 64).convert("RGB"), "PNG")
    limits = MediaLimits(max_total_bytes=3 * len(img))
    open_images([Media(img, "image/png")] * 3, limits)
    with pytest.raises(MediaError, match="request's images hold"):
        open_images([Media(img, "image/png")] * 4, limits)


@pytest.mark.parametrize("fmt,mode", [("JPEG", "RGB"), ("PNG", "P"), ("WEBP", "RGB")])
def test_a_large_image_is_decoded_straight_to_the_bounded_size_with_its_aspect(fmt, mode):
    big = Image.linear_gradient("L").resize((1500, 1000)).convert(mode)
    (img,) = open_images([Media(encoded(big.convert("RGB") if fmt != "PNG" else big, fmt), None)],
                         MediaLimits(decode_pixels=150_000))  # fmt: skip
    assert img.mode == "RGB"
    assert 120_000 < img.width * img.height <= 150_000
    assert abs(img.width / img.height - 1.5) < 0.01


def _rss_mb(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) // 1024
    raise AssertionError(f"no {field}")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="peak memory is read from Linux's /proc")
def test_sixteen_large_images_hold_one_full_size_image_at_a_time(record_property):
    big = Image.new("RGB", (2000, 2000), (30, 160, 90))
    ImageDraw.Draw(big).rectangle((500, 500, 1000, 1000), fill=(20, 20, 220))
    data = encoded(big)  # 16 MB of pixels each, decoded (Pillow keeps RGB in 4 bytes)
    del big
    gc.collect()
    base = _rss_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak starts again from here
    images = open_images([Media(data, "image/png")] * 16, MediaLimits(decode_pixels=250_000))
    grew = _rss_mb("VmHWM") - base
    record_property("sixteen_images_peak_mb", grew)
    print(f"16 images of 2000x2000 decoded to 500x500: peak +{grew} MB")
    assert all(img.size == (500, 500) for img in images)
    assert grew < 120, f"the peak grew {grew} MB: full-size images were held together (16 would be 256 MB)"


def test_a_small_image_is_decoded_as_it_is():
    small = Image.effect_noise((64, 48), 50).convert("RGB")
    (img,) = open_images([Media(encoded(small), "image/png")])
    assert img.size == (64, 48) and img.tobytes() == small.tobytes()


# ------------------------------------------------------------------ EXIF orientation (item 8)


@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_exif_orientation_is_applied_as_transformers_load_image_does(orientation):
    photo = Image.new("RGB", (40, 20), (0, 0, 0))
    photo.paste((255, 255, 255), (0, 0, 10, 10))  # a white corner shows which way it turned
    exif = Image.Exif()
    exif[0x0112] = orientation
    data = encoded(photo, "PNG", exif=exif.tobytes())
    (img,) = open_images([Media(data, "image/png")])
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")  # what load_image gives
    assert img.size == upright.size and img.tobytes() == upright.tobytes()
    assert img.size == ((20, 40) if orientation in (6, 8) else (40, 20))


# ------------------------------------------------------------------ fetching image URLs (item 2)

PNG = encoded(Image.new("RGB", (4, 4), (1, 2, 3)))
BIG = 2**20


class _Images(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/")
            self.end_headers()
            return
        if self.path == "/missing":
            self.send_error(404)
            return
        if self.path.startswith("/big"):  # a 1 MiB image (its tail is padding)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                self.wfile.write(PNG + bytes(BIG - len(PNG)))
            except OSError:
                pass  # cut by the client mid-body
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG) + 40))
        self.end_headers()
        if self.path == "/trickle":  # a byte every 0.1 s: 5 s for the whole image
            try:
                for b in PNG + bytes(40):
                    self.wfile.write(bytes([b]))
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:
                pass  # cut by the client, as it should be
            return
        self.wfile.write(PNG + bytes(40))

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def images_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def served(**kw) -> MediaLimits:
    return MediaLimits(fetch_urls=True, **kw)


def test_the_operators_allow_list_lets_the_local_server_through(images_server):
    m = media_from_url(f"http://127.0.0.1:{images_server}/a.png", served(fetch_allow=("127.0.0.1",)))
    assert m.data == PNG + bytes(40)
    m = media_from_url(f"http://localhost:{images_server}/a.png", served(fetch_allow=("localhost",)))
    assert m.data.startswith(PNG)
    assert media_from_url(f"http://127.0.0.1:{images_server}/a.png", in_process_limits()).data.startswith(PNG)


@pytest.mark.parametrize(
    "host",
    ["127.0.0.1", "localhost", "2130706433", "0x7f000001", "[::1]", "10.0.0.1", "192.168.1.1", "169.254.169.254"],
)
def test_loopback_private_and_link_local_hosts_are_refused_with_one_answer(images_server, host):
    limits = served(fetch_timeout=2.0)
    with pytest.raises(MediaError) as refused:
        media_from_url(f"http://{host}:{images_server}/a.png", limits)
    with pytest.raises(MediaError) as missing:
        media_from_url(
            f"http://127.0.0.1:{images_server}/missing", served(fetch_timeout=2.0, fetch_allow=("127.0.0.1",))
        )
    assert str(refused.value) == str(missing.value)  # nothing tells the internal network from a missing image
    assert host.strip("[]") not in str(refused.value)


def test_a_redirect_is_not_followed(images_server):
    with pytest.raises(MediaError, match="without a redirect"):
        media_from_url(f"http://127.0.0.1:{images_server}/redirect", served(fetch_allow=("127.0.0.1",)))


def test_a_trickling_server_is_cut_at_the_deadline(images_server, record_property):
    limits = served(fetch_timeout=1.0, fetch_allow=("127.0.0.1",))
    t0 = time.perf_counter()
    with pytest.raises(MediaError, match="within 1 s"):
        media_from_url(f"http://127.0.0.1:{images_server}/trickle", limits)
    took = time.perf_counter() - t0
    record_property("trickle_cut_s", round(took, 2))
    assert took < 1.5, took


def test_a_requests_fetches_stop_at_its_total_while_they_read(images_server):
    """Each image's bytes are counted as they arrive against the request's total (64 MB by default), not after all
    its URLs were fetched and held."""
    limits = served(fetch_allow=("127.0.0.1",), max_total_bytes=int(2.5 * BIG)).for_request()
    got = [media_from_url(f"http://127.0.0.1:{images_server}/big{i}", limits) for i in range(2)]
    assert [len(m.data) for m in got] == [BIG, BIG] and limits.tally.spent == 2 * BIG
    with pytest.raises(MediaError, match="request's images hold"):
        media_from_url(f"http://127.0.0.1:{images_server}/big2", limits)
    assert limits.tally.spent == 2 * BIG  # the third was cut once it passed the total, and holds nothing
    alone = served(fetch_allow=("127.0.0.1",), max_total_bytes=int(2.5 * BIG))  # no request tally: each alone
    assert len(media_from_url(f"http://127.0.0.1:{images_server}/big3", alone).data) == BIG
