"""The verifying client's download path (kdnctl/store/fetch.py) against a real HTTP server on
127.0.0.1 that misbehaves on purpose: lying lengths, bodies cut short, bad resume ranges,
flipped bytes. Every byte is checked (BLAKE3 from the version listing, else the sha256 name),
keep-alive connections are reused across objects, and nothing hostile is handed back."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from kdnctl.store.client import RemoteStore
from kdnctl.errors import NotFoundError, RemoteError, StoreCorruptError
from kdnctl.store.fastread import blake3_hex, new_buffer
from kdnctl.store import ChunkRef, VersionRecord

SIZE = 5 * (1 << 20) + 12345  # several slices (hashed on the hash lane), and an odd length


class Origin:
    """A tiny object server: ``mode`` decides how it misbehaves; counts connections and requests."""

    def __init__(self, objects: dict[str, bytes]):
        self.objects, self.mode, self.cut = objects, "ok", False
        self.connections = self.requests = 0
        self.ranges: list[str] = []
        self.paths: list[str] = []
        origin = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                origin.connections += 1

            def log_message(self, *args):
                pass

            def do_GET(self):
                origin.requests += 1
                origin.handle(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def listing(self) -> dict:
        chunks = [ChunkRef(i, sha, i, i + 1, f"{i:064x}", len(data), blake3_hex(data))
                  for i, (sha, data) in enumerate(self.objects.items())]
        v = VersionRecord("d", "v1", "full", None, {}, "fp", chunks, 0.0, len(chunks))
        return dataclasses.asdict(v)

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        self.paths.append(h.path)
        path = urlsplit(h.path).path  # a proxy gets absolute URIs
        if path == "/v1/docs/d/versions/full":
            return self.send(h, 200, json.dumps(self.listing()).encode(), {"content-type": "application/json"})
        sha = path.rsplit("/", 1)[-1]
        if sha not in self.objects:
            return self.send(h, 404, b'{"error": "no such object"}', {})
        data, rng = self.objects[sha], h.headers.get("range")
        if rng:
            self.ranges.append(rng)
            start = int(rng.split("=")[1].rstrip("-"))
            if self.mode == "bad-range" and len(self.ranges) == 1:
                start += 1  # answers a range other than the one asked for
                return self.send(h, 206, data[start:], {"content-range": f"bytes {start}-{len(data) - 1}/{len(data)}"})
            return self.send(h, 206, data[start:], {"content-range": f"bytes {start}-{len(data) - 1}/{len(data)}"})
        if self.mode == "lie-length":
            h.close_connection = True
            return self.send(h, 200, b"", {}, length=1 << 39)
        if self.mode == "flip":
            data = bytearray(data)
            data[len(data) // 2] ^= 1
            return self.send(h, 200, bytes(data), {})
        if self.mode in ("cut", "bad-range") and not self.cut:  # half the body, then hang up
            self.cut = True
            self.send(h, 200, data[: len(data) // 2], {}, length=len(data))
            h.close_connection = True
            return
        self.send(h, 200, data, {})

    @staticmethod
    def send(h, status: int, body: bytes, headers: dict, length: int | None = None) -> None:
        h.send_response(status)
        h.send_header("content-length", str(len(body) if length is None else length))
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        try:
            h.wfile.write(body)
        except OSError:
            pass

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def origin():
    objects = {}
    for i in range(3):
        data = os.urandom(SIZE + i)
        objects[hashlib.sha256(data).hexdigest()] = data
    srv = Origin(objects)
    yield srv
    srv.stop()


def _remote(origin, learn=True, **kw) -> RemoteStore:
    remote = RemoteStore(origin.url, retries=3, **kw)
    remote._backoff = lambda attempt: None  # no sleeping between retries in tests
    if learn:
        remote.get_version("d")  # what load_document does first: learns BLAKE3 and sizes
    return remote


def test_downloads_are_verified_and_reuse_one_connection(origin):
    with _remote(origin) as remote:
        for sha, data in origin.objects.items():
            got = remote.read_object(sha)
            assert isinstance(got, bytearray) and got == data
        assert remote.fetch_objects(list(origin.objects), max_workers=1) == origin.objects
        # one listing request (httpx) + one keep-alive connection for all six object downloads
        assert origin.connections == 2 and remote.stats["retries"] == 0
    with _remote(origin, learn=False) as remote:  # no listing: checked by the sha256 name
        sha = next(iter(origin.objects))
        assert remote.read_object(sha) == origin.objects[sha]


@pytest.mark.parametrize("learn", [True, False], ids=["blake3", "sha256"])
def test_a_flipped_byte_is_refused_either_way(origin, learn):
    origin.mode = "flip"
    sha = next(iter(origin.objects))
    with _remote(origin, learn) as remote, pytest.raises(StoreCorruptError, match="corrupted"):
        remote.read_object(sha)


def test_a_body_cut_short_resumes_with_range(origin):
    origin.mode = "cut"
    sha, data = next(iter(origin.objects.items()))
    with _remote(origin) as remote:
        assert remote.read_object(sha) == data
        assert remote.stats["resumed"] == 1 and remote.stats["retries"] == 1
    assert origin.ranges == [f"bytes={len(data) // 2}-"]


def test_a_wrong_resume_range_is_not_stitched(origin):
    origin.mode = "bad-range"
    sha, data = next(iter(origin.objects.items()))
    with _remote(origin) as remote:
        assert remote.read_object(sha) == data  # the bad 206 is dropped; a later attempt completes it
        assert remote.stats["retries"] >= 2


def test_a_lying_length_is_refused_before_allocating(origin):
    origin.mode = "lie-length"
    sha = next(iter(origin.objects))
    with _remote(origin) as remote, pytest.raises(StoreCorruptError, match="announces 549755813888 bytes"):
        remote.read_object(sha)  # 512 GiB announced: refused from the listing's size, no buffer
    with _remote(origin, learn=False) as remote, pytest.raises(RemoteError, match="failed after 4 attempt"):
        remote.read_object(sha)  # unknown size: the body never comes, retried, then an error


def test_missing_objects_and_buffers(origin):
    with _remote(origin) as remote, pytest.raises(NotFoundError):
        remote.read_object("ab" * 32)
    buf = new_buffer(10)
    assert isinstance(buf, bytearray) and len(buf) == 10 and new_buffer(0) == bytearray()


def test_the_proxy_environment_applies_to_downloads_too(origin, monkeypatch):
    """HTTP_PROXY sends the object downloads (like httpx's JSON requests) to the proxy, with
    absolute URIs; NO_PROXY exempts a host. The origin here plays the forward proxy."""
    for name in ("http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, origin.url)
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(name, "")
    sha, data = next(iter(origin.objects.items()))
    with RemoteStore("http://kdn.invalid:8700") as remote:
        remote.get_version("d")
        assert remote.read_object(sha) == data
    assert origin.paths[-1] == f"http://kdn.invalid:8700/v1/objects/{sha}"
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.setenv(name, "kdn.invalid")
    with RemoteStore("http://kdn.invalid:8700", retries=0) as remote, pytest.raises(RemoteError):
        remote.read_object(sha)  # not proxied: the name does not resolve


def test_the_hash_lane_hashes_every_slice_in_order_before_answering():
    from kdnctl.store.fetch import LANE_MIN_BYTES, HashLane

    assert SIZE >= LANE_MIN_BYTES  # the downloads above go through the lane
    data = os.urandom(3 << 20)
    lane = HashLane(hashlib.sha256())
    view = memoryview(data)
    for at in range(0, len(data), 100_003):  # uneven slices, queued faster than hashed
        lane.update(view[at : at + 100_003])
    assert lane.hexdigest() == hashlib.sha256(data).hexdigest()
    lane.close()  # idempotent once answered

    class Broken:
        def update(self, _):
            raise ValueError("hasher failed")

    bad = HashLane(Broken())
    bad.update(b"x")
    with pytest.raises(ValueError, match="hasher failed"):
        bad.hexdigest()
