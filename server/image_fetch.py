"""Fetching an http(s) image URL within a total deadline, from public addresses only.

    data = fetch_url(url, settings, fail)   # bytes, or fail(reason) raised: "could not fetch the image (...)"

The deadline covers everything (name lookup, connect, TLS, headers, every redirect, the body):
a watchdog shuts the socket down when it passes, so a host trickling a byte at a time cannot
hold the fetch past it. Every address a name resolves to is checked before connecting, on
every redirect, and the connection goes to a checked address (a name that resolves to a
public address once and to 127.0.0.1 the next time reaches nothing inside). Loopback,
private, link-local, multicast, reserved and unspecified addresses are refused unless
listed in `ImageSettings.fetch_allow_hosts` (a host name as the URL spells it, an address,
or a network such as 10.0.0.0/8). Failures name a reason class only (not allowed, timed
out, too large, failed, empty): they never tell a refused port from an HTTP error.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
from typing import List, Optional, Tuple, Union
from urllib.parse import urljoin, urlsplit

FETCH_CHUNK = 1 << 16
MAX_REDIRECTS = 5
REDIRECTS = (301, 302, 303, 307, 308)
Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]


class FetchFailed(Exception):
    """Why a fetch failed, as the client is told it (a reason class, nothing about the host)."""


def not_allowed() -> FetchFailed:
    return FetchFailed("its address is not allowed: loopback, private, link-local, multicast and reserved addresses "
                       "are not fetched (--image-fetch-allow-hosts lists exceptions)")


def timed_out(seconds: float) -> FetchFailed:
    return FetchFailed(f"timed out: longer than {seconds:g} s in all (--image-fetch-timeout)")


def too_large(limit: int, at_least: int) -> FetchFailed:
    return FetchFailed(f"too large: the image has {at_least:,} bytes; at most {limit:,} per image (--max-image-bytes)")


FAILED = "the request failed (no answer, an HTTP error or too many redirects)"


class AllowList:
    """`--image-fetch-allow-hosts`: host names (as URLs spell them), addresses and networks whose
    fetches skip the address check."""

    def __init__(self, entries: Tuple[str, ...] = ()):
        self.names = set()
        self.networks: List[Network] = []
        for entry in entries:
            entry = entry.strip().lower().strip("[]")
            if not entry:
                continue
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.names.add(entry.rstrip("."))

    def allows(self, host: str, address: Address) -> bool:
        return host.lower().rstrip(".") in self.names or any(address in net for net in self.networks) or public(address)


def public(address: Address) -> bool:
    """An address a fetch may reach by default (IPv4-mapped IPv6 addresses judged as IPv4)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not (address.is_private or address.is_loopback or address.is_link_local
                                      or address.is_multicast or address.is_reserved or address.is_unspecified)


def parse_allow_hosts(text: str) -> Tuple[str, ...]:
    """The flag's comma-separated list; ValueError for an entry that is neither a name nor a network."""
    out = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        bare = entry.strip("[]")
        if "/" in bare:
            ipaddress.ip_network(bare, strict=False)  # ValueError names it
        elif not all(c.isalnum() or c in ".-_:" for c in bare):
            raise ValueError(f"{entry!r} is not a host name, an address or a network")
        out.append(entry)
    return tuple(out)


class Watchdog:
    """Shuts the watched socket down at the deadline: a blocked read or write returns at once."""

    def __init__(self, deadline: float):
        self.fired = False
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(0.0, deadline - time.monotonic()), self._fire)
        self._timer.daemon = True
        self._timer.start()

    def _fire(self) -> None:
        with self._lock:
            self.fired = True
            self._shut()

    def _shut(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def watch(self, sock: Optional[socket.socket]) -> None:
        with self._lock:
            self._sock = sock
            if self.fired:
                self._shut()

    def cancel(self) -> None:
        self._timer.cancel()


def fetch_url(url: str, max_bytes: int, timeout: float, allow: AllowList) -> bytes:
    """The body of a 200 answer to GET `url`, following at most MAX_REDIRECTS redirects;
    FetchFailed naming the reason class."""
    deadline = time.monotonic() + timeout
    dog = Watchdog(deadline)
    try:
        for _ in range(MAX_REDIRECTS + 1):
            body, location = _get(url, max_bytes, deadline, allow, dog)
            if location is None:
                if not body:
                    raise FetchFailed("the answer had no data")
                return body
            url = urljoin(url, location)
        raise FetchFailed(FAILED)
    except FetchFailed:
        raise
    except (OSError, http.client.HTTPException, ValueError) as e:  # refused, reset, TLS, a malformed answer, the watchdog
        if dog.fired or time.monotonic() >= deadline:
            raise timed_out(timeout) from e
        raise FetchFailed(FAILED) from e
    finally:
        dog.cancel()
        dog.watch(None)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _get(url: str, max_bytes: int, deadline: float, allow: AllowList, dog: Watchdog) -> Tuple[bytes, Optional[str]]:
    """One hop: (body, None), or (b"", the redirect's Location)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchFailed(FAILED)
    host = parts.hostname
    port = parts.port or (443 if parts.scheme == "https" else 80)
    sock = _connect(host, port, deadline, allow, dog)
    try:
        if parts.scheme == "https":
            sock = tls_context().wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
            dog.watch(sock)
            sock.settimeout(_remaining(deadline))
            sock.do_handshake()
        sock.sendall(_request(parts, host, port))
        r = http.client.HTTPResponse(sock, method="GET")
        r.begin()
        if r.status in REDIRECTS and r.getheader("location"):
            return b"", r.getheader("location")
        if r.status != 200:
            raise FetchFailed(FAILED)
        length = r.getheader("content-length") or ""
        if length.isdigit() and int(length) > max_bytes:
            raise too_large(max_bytes, int(length))
        chunks, size = [], 0
        while True:
            sock.settimeout(_remaining(deadline))
            chunk = r.read(FETCH_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes, size)
            chunks.append(chunk)
        _remaining(deadline)
        return b"".join(chunks), None
    finally:
        sock.close()


def tls_context() -> ssl.SSLContext:
    """Certificates verified against certifi's bundle (httpx's dependency) where it is installed:
    some Python builds (python.org's on macOS) ship without the system's."""
    try:
        import certifi

        return ssl.create_default_context(cafile=certifi.where())
    except ImportError:
        return ssl.create_default_context()


def _request(parts, host: str, port: int) -> bytes:
    """GET's request head (the URL's path and query; no control characters or spaces)."""
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in target):
        raise FetchFailed(FAILED)
    name = f"[{host}]" if ":" in host else host
    if port != (443 if parts.scheme == "https" else 80):
        name += f":{port}"
    return (f"GET {target} HTTP/1.1\r\nHost: {name}\r\nAccept: image/*\r\nUser-Agent: mtp-serve\r\n"
            "Connection: close\r\n\r\n").encode("ascii", "strict")


def _connect(host: str, port: int, deadline: float, allow: AllowList, dog: Watchdog) -> socket.socket:
    """A socket connected to one of `host`'s addresses, every one of which the allow list accepts."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    addresses = [(info, ipaddress.ip_address(info[4][0].split("%", 1)[0])) for info in infos]
    if not addresses or not all(allow.allows(host, a) for _, a in addresses):
        raise not_allowed()
    error: Optional[BaseException] = None
    for (family, kind, proto, _, sockaddr), _ in addresses:
        sock = socket.socket(family, kind, proto)
        dog.watch(sock)
        try:
            sock.settimeout(_remaining(deadline))
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error or OSError("no address")

