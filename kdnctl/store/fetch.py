"""Object downloads at the speed the network delivers, every byte checked.

The verifying client's hot path (``RemoteStore.read_object``) does not go through httpx: its
per-block machinery (h11 events, a 64 KB ``iter_bytes`` loop, ``buf += block`` reallocation
and a final ``bytes(buf)`` copy) held it near 250 MB/s on loopback. Here one keep-alive
``http.client`` connection per concurrent download receives the body straight into one
preallocated ``bytearray`` of the announced size (``readinto`` on big slices: the socket read
releases the GIL and fills each slice in one call), and each slice is hashed as soon as it has
arrived, from the same buffer (BLAKE3 when the catalog recorded it, else sha256), on a hash lane
of its own (``HashLane``) while the next slice is received; the buffer is handed back only after
the last slice is hashed. The caller
gets that buffer: no copy between the socket and the decoder. Buffers come from a pool
(kdnctl/store/arena.py) of exact-size bytearrays that nothing references any more: writing into fresh
memory (first-touch page faults) bounded downloads at ~0.7 GB/s here, into memory a previous
load used they run at the transport's speed.

Connections are pooled (thread-safe) and reused across objects; one that saw an error or a
response that closes is dropped. ``https://`` uses the default SSL context; the proxy
environment (``HTTP_PROXY``, ``HTTPS_PROXY``, ``NO_PROXY``) is honoured like httpx does.
"""

from __future__ import annotations

import http.client
import queue
import re
import threading
from dataclasses import dataclass, field
from typing import Callable
from urllib.parse import urlsplit
from urllib.request import getproxies, proxy_bypass

from .fastread import new_buffer

SLICE_BYTES = 2 << 20  # received, hashed (on the hash lane, while the next one arrives) and reported per slice
LANE_MIN_BYTES = 2 * SLICE_BYTES  # smaller objects are hashed inline (a thread costs more than it saves)
MAX_OBJECT_BYTES = 1 << 40  # a Content-Length beyond this is a broken or hostile server
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


class Retry(Exception):
    """A failure worth retrying (connection trouble, a short body, 5xx, a bad range answer)."""


class WrongSize(Exception):
    """The server announces a length other than the catalog's size for the object: refused
    before a buffer is allocated for it (a hostile length must not cost memory)."""


class Refused(Exception):
    """A final HTTP answer that is not the object: ``status``, ``reason``, ``body``."""

    def __init__(self, status: int, reason: str, body: bytes):
        super().__init__(f"HTTP {status}")
        self.status, self.reason, self.body = status, reason, body


class ConnectionPool:
    """Idle keep-alive connections to one origin; ``get`` hands one out, ``put`` takes it back."""

    def __init__(self, url: str, timeout: float, max_idle: int = 64):
        parts = urlsplit(url)
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port
        self.base = parts.path.rstrip("/")
        self.timeout, self.max_idle = timeout, max_idle
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()
        # the proxy environment (HTTP(S)_PROXY, NO_PROXY) applies as it does to the JSON
        # requests (httpx): http:// through the proxy with absolute URIs, https:// tunnelled
        self.proxy = None
        proxy = getproxies().get(parts.scheme)
        if proxy and not proxy_bypass(parts.netloc):
            p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            self.proxy = (p.hostname, p.port or 80)
            if not self.https:
                self.base = f"http://{parts.netloc}{self.base}"

    def get(self) -> http.client.HTTPConnection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        if self.proxy is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            return cls(self.host, self.port, timeout=self.timeout)
        if not self.https:
            return http.client.HTTPConnection(*self.proxy, timeout=self.timeout)
        conn = http.client.HTTPSConnection(*self.proxy, timeout=self.timeout)
        conn.set_tunnel(self.host, self.port)
        return conn

    def put(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class HashLane:
    """A hasher fed on a thread of its own: ``update`` queues a slice and returns at once, so
    the caller receives the next slice while this one is hashed (the socket read and the BLAKE3
    / sha256 update both release the GIL: on two cores they run side by side). Slices are hashed
    in the order given; ``hexdigest`` waits for every queued slice first, so nothing is reported
    (or handed to the caller) before every byte has been hashed. The queued slices are views of
    the download buffer, which therefore stays referenced (out of the pool) until then."""

    def __init__(self, hasher):
        self._hasher, self._error = hasher, None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kdn-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._hasher.update(item)
                except BaseException as exc:  # (reported by hexdigest, on the caller's thread)
                    self._error = exc

    def update(self, data) -> None:
        self._queue.put(data)

    def close(self) -> None:
        """Wait for the queued slices (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def hexdigest(self) -> str:
        self.close()
        if self._error is not None:
            raise self._error
        return self._hasher.hexdigest()


@dataclass
class Partial:
    """A download in progress: the buffer (sized from the first answer), bytes received and
    hashed so far, the running hash. Survives retries so a resumed download continues it."""

    new_hasher: Callable
    expect: int | None = None  # the object's size from the catalog, when known
    buf: bytearray | None = None
    got: int = 0
    stitched: bool = False
    hasher: object = field(default=None)

    def close(self) -> None:
        if isinstance(self.hasher, HashLane):
            self.hasher.close()

    def restart(self, size: int) -> None:
        from .arena import FETCH_POOL

        self.close()  # (the old lane's slices view the old buffer)
        self.buf = self.hasher = None  # (a retry's old buffer goes back first)
        self.buf = FETCH_POOL.take(size, exact=True) if size else new_buffer(0)
        self.got = 0
        self.hasher = HashLane(self.new_hasher()) if size >= LANE_MIN_BYTES else self.new_hasher()


def _content_length(resp: http.client.HTTPResponse) -> int:
    value = resp.getheader("content-length")
    if value is None or not value.isdigit() or int(value) > MAX_OBJECT_BYTES:
        raise Retry(f"object answer without a usable Content-Length ({value!r})")
    return int(value)


def fetch_once(pool: ConnectionPool, path: str, headers: dict, etag: str, part: Partial,
               on_bytes: Callable[[int], None]) -> None:
    """One GET of ``path`` into ``part`` (resuming with Range from ``part.got``); returns when
    ``part.buf`` is complete. Raises Retry (try again), Refused (a final non-object answer) or
    OSError / http.client.HTTPException (connection trouble: retry)."""
    conn = pool.get()
    reusable = False
    try:
        req = dict(headers)
        if part.got:  # resume: valid only while the server still has the very same object
            req["range"] = f"bytes={part.got}-"
            req["if-range"] = etag
        conn.request("GET", pool.base + path, headers=req)
        resp = conn.getresponse()
        status = resp.status
        if status == 206 and part.got:
            m = _CONTENT_RANGE.match(resp.getheader("content-range") or "")
            if (not m or int(m.group(1)) != part.got or int(m.group(3)) != len(part.buf)
                    or _content_length(resp) != len(part.buf) - part.got):
                raise Retry(f"bad Content-Range {resp.getheader('content-range')!r}")
            part.stitched = True
        elif status == 200:
            size = _content_length(resp)
            if part.expect is not None and size != part.expect:
                raise WrongSize(f"the server announces {size} bytes for an object the version lists at "
                                f"{part.expect}")
            try:
                part.restart(size)
            except MemoryError:
                raise Retry(f"no memory for an object of {size} bytes") from None
        elif status == 416:  # our range went stale: start over
            part.buf, part.got = None, 0
            resp.read()
            raise Retry("range not satisfiable")
        elif status >= 500:
            resp.read()
            raise Retry(f"HTTP {status}")
        else:
            body = resp.read(1 << 16)
            raise Refused(status, resp.reason, body)
        view = memoryview(part.buf)
        size = len(part.buf)
        while part.got < size:
            end = min(part.got + SLICE_BYTES, size)
            n = resp.readinto(view[part.got:end])
            if not n:
                raise Retry(f"connection closed after {part.got} of {size} bytes")
            part.hasher.update(view[part.got:part.got + n])
            part.got += n
            on_bytes(n)
        reusable = not resp.will_close and resp.read(1) == b""
    finally:
        if reusable:
            pool.put(conn)
        else:
            conn.close()
