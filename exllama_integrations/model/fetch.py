"""An http(s) image fetched for a request, only where it is safe, within one deadline and the request's bytes.

The host is resolved once, and every address it names must be a global one (not loopback, private, link-local,
shared or reserved) unless the operator's ``fetch_allow`` lists it; the connection goes to the address that was
checked (DNS cannot swap it after the check), no redirect is followed, and one deadline covers the whole fetch
(connect, headers and body, however slowly they trickle). The body is counted as it arrives against the image's
``max_bytes`` and the request's ``max_total_bytes`` (its :class:`~.media.Tally`). Every refused fetch says the same
thing, so the answers do not map the network behind the server.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from typing import Any, Protocol
from urllib.parse import urlsplit

from ..errors import MediaError

logger = logging.getLogger(__name__)


class FetchLimits(Protocol):
    """What a fetch reads of a request's :class:`~.media.MediaLimits` (the caller's; this module imports none)."""

    @property
    def fetch_reasons(self) -> bool: ...
    @property
    def fetch_timeout(self) -> float: ...
    @property
    def fetch_allow(self) -> tuple[str, ...]: ...
    @property
    def max_bytes(self) -> int: ...
    @property
    def max_total_bytes(self) -> int: ...
    @property
    def tally(self) -> Any: ...


def over_total(total: int, limit: int) -> str:
    """The refusal of a request whose images hold ``total`` bytes, over ``limit``."""
    return (
        f"a request's images hold {total} bytes, more than the {limit} taken in one request; send fewer or smaller "
        "images."
    )


REFUSED_FETCH = (
    "the image URL could not be fetched (this server fetches only reachable public http(s) images that answer "
    "within {timeout:g} s, without a redirect, and are at most {size} bytes); send the image as a data: URL "
    "(data:image/png;base64,...)."
)
"""What every refused fetch says (the reason is logged, not told: it would map the server's network)."""


class _Refused(Exception):
    """Why a fetch was refused (logged; the caller gets :data:`REFUSED_FETCH`)."""


def _allowed(host: str, address: str, allow: tuple[str, ...]) -> bool:
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1 is loopback
    if ip.is_global and not ip.is_multicast:
        return True
    for entry in allow:
        if entry == "*" or entry.lower() == host.lower():
            return True
        try:
            if ip in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:
            continue  # a host name that is not this one
    return False


def fetch_image(url: str, limits: FetchLimits) -> bytes:
    """The bytes of an http(s) image (see the module docstring for what is refused).

    Raises:
        MediaError: the fetch was refused (one answer for every reason, unless ``limits.fetch_reasons``), or the
            image would take the request's images past their total.
    """
    try:
        return _fetch_checked(url, limits)
    except MediaError:
        raise  # the request's own total, said as it is (it maps nothing)
    except _Refused as e:
        why = str(e)
    except (OSError, ValueError) as e:  # ssl errors, resets, bad responses, a closed socket at the deadline
        why = f"{type(e).__name__}: {e}"
    logger.info("refused to fetch an image URL: %s", why)
    if limits.fetch_reasons:
        raise MediaError(f"fetching the image failed: {why}.")
    raise MediaError(REFUSED_FETCH.format(timeout=limits.fetch_timeout, size=limits.max_bytes))


def _fetch_checked(url: str, limits: FetchLimits) -> bytes:
    import http.client
    import ssl

    deadline = time.monotonic() + limits.fetch_timeout
    parts = urlsplit(url)
    host, scheme = parts.hostname, parts.scheme.lower()
    if not host or parts.username or parts.password:
        raise _Refused("no host, or credentials in the URL")
    port = parts.port or (443 if scheme == "https" else 80)
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise _Refused(f"{host!r} does not resolve: {e}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
    if not addresses or not all(_allowed(host, a, limits.fetch_allow) for a in addresses):
        raise _Refused(f"{host!r} resolves to {addresses}, not all global or allowed")
    sock = socket.create_connection((addresses[0], port), timeout=max(0.01, deadline - time.monotonic()))
    late = threading.Event()
    live = [sock]
    conn: http.client.HTTPConnection | None = None

    def cut() -> None:  # one deadline for everything after: a trickle is cut mid-read
        late.set()
        try:
            live[-1].shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), cut)
    timer.daemon = True
    timer.start()
    try:
        if scheme == "https":
            live.append(ssl.create_default_context().wrap_socket(sock, server_hostname=host))
            conn = http.client.HTTPSConnection(host, port, timeout=limits.fetch_timeout)
            conn.sock = live[-1]
        else:
            conn = http.client.HTTPConnection(host, port, timeout=limits.fetch_timeout)
            conn.sock = sock  # the address that was checked: the name is not resolved again
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", path, headers={"Accept": "image/*"})
        resp = conn.getresponse()
        if resp.status != 200:
            redirect = (
                " (a redirect: redirects are not followed, give the final URL)" if 300 <= resp.status < 400 else ""
            )
            raise _Refused(f"HTTP {resp.status}{redirect}")
        mime = resp.headers.get_content_type()
        if not mime.startswith("image/"):
            raise _Refused(f"the URL's content of type {mime!r} is not an image")
        chunks, size = [], 0
        while True:
            chunk = resp.read1(64 * 1024)
            if late.is_set():
                raise _Refused(f"slower than {limits.fetch_timeout} s")
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size > limits.max_bytes:
                raise _Refused(f"larger than {limits.max_bytes} bytes")
            if limits.tally is not None and size > limits.tally.left(limits.max_total_bytes):
                raise MediaError(over_total(limits.tally.spent + size, limits.max_total_bytes))
        if late.is_set():
            raise _Refused(f"slower than {limits.fetch_timeout} s")
        return b"".join(chunks)
    except OSError:
        if late.is_set():
            raise _Refused(f"slower than {limits.fetch_timeout} s") from None
        raise
    finally:
        timer.cancel()
        if conn is not None:
            conn.close()
        for each in live:
            each.close()
