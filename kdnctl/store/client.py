"""RemoteStore: the Store read interface over `kdnctl serve-files`, and `mirror` for `kdnctl pull`.

The engine loader only needs ``get_version``, ``read_object``, ``lookup_chunk`` and
``chunk_sizes``; RemoteStore answers those (and the other read methods) over HTTP, returning
the same dataclasses as kdnctl.store, so ``load_document(lm, RemoteStore(url), doc)`` works.

The network is not trusted: every object is re-hashed before it is returned or cached, and a
mismatch raises StoreCorruptError instead of handing damaged KV to a model. Downloads retry on
connection errors and 5xx with exponential backoff, resuming with ``Range`` from the bytes
already received (the object is immutable, so ``If-Range`` on its hash makes the stitch safe).
"""

from __future__ import annotations

import functools
import hashlib
import http.client
import json
import os
import random
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import quote

import httpx

from .. import __version__
from ..errors import NotFoundError, RemoteError, StoreCorruptError, UsageError
from .fastread import blake3_hasher, check_bytes, read_into
from .fetch import ConnectionPool, Partial, Refused, Retry, WrongSize, fetch_once
from . import ChunkRef, DocumentRecord, VersionRecord, check_sha
_LINK = re.compile(r"^e=(\d{1,12})&s=[A-Za-z0-9_-]{1,64}$")
TOKEN_HINT = ("pass --token-file with a token from the server's token file, and check that it grants "
              "the document's namespace")


def _doc(d) -> DocumentRecord:
    # the same validating decoder the local catalog uses: a hostile or broken server's records
    # end as StoreCorruptError naming the field, never as a TypeError in the loader
    return DocumentRecord.from_dict(d, "document record from the server")


def _version(d) -> VersionRecord:
    return VersionRecord.from_dict(d, "version record from the server")


def _q(part: str) -> str:
    # encode "/" too: the server splits the raw path, so ids containing "/" stay exact
    return quote(part, safe="")


@functools.lru_cache(maxsize=1)
def _tls_context():
    """httpx's default verifying context (its CA bundle, ``SSL_CERT_FILE``/``SSL_CERT_DIR`` where
    set), made once per process and shared by every client."""
    return httpx.create_ssl_context()


class RemoteStore:
    """Read-only view of a store served by `kdnctl serve-files` at ``url``.

    ``cache_dir`` (default: ``$KDN_REMOTE_CACHE``, else no disk cache) keeps verified objects,
    content-addressed, so repeated loads skip the network. Thread-safe."""

    def __init__(self, url: str, token: str | None = None, cache_dir: str | os.PathLike | None = None,
                 retries: int = 4, timeout: float = 30, max_workers: int = 8):
        if not isinstance(url, str) or not re.match(r"^https?://[^/]", url):
            raise UsageError(f"remote URL {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.retries = max(0, int(retries))
        self.max_workers = max(1, int(max_workers))
        cache_dir = cache_dir if cache_dir is not None else os.environ.get("KDN_REMOTE_CACHE") or None
        self.cache_dir = Path(cache_dir) if cache_dir else None
        headers = {"user-agent": f"kdnctl/{__version__}"}
        if token:
            headers["authorization"] = f"Bearer {token.strip()}"
        # TLS settings only for an https URL: every request goes to this base URL and no redirect is
        # followed, so a plain-http client never makes a TLS connection, and building the CA
        # bundle's context (~20 ms) is the largest fixed cost of a `kdnctl ask --remote URL`
        verify = _tls_context() if self.url.startswith("https://") else False
        self._client = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, verify=verify,
                                    limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
        self._headers = headers  # object downloads: raw keep-alive connections (kdnctl/store/fetch.py)
        self._pool = ConnectionPool(self.url, timeout)
        self._lock = threading.Lock()
        self.stats = {"requests": 0, "retries": 0, "resumed": 0, "bytes": 0, "cache_hits": 0}
        # sha256 -> BLAKE3 recorded by the server's catalog (ChunkRef.blake3), learnt from the
        # version listings that name the objects (same trust as the names): objects with one
        # are verified at BLAKE3 speed; others by their sha256 name.
        self._blake3: dict[str, str] = {}
        # sha256 -> size from the same listings: a server announcing another length is refused
        # before anything is allocated for it
        self._nbytes: dict[str, int] = {}
        # sha256 -> (signed query, expiry): nginx sends these without a kdnctl round trip
        self._links: dict[str, tuple[str, int]] = {}
        # Progress hook, called as hook(sha, bytes_received) after each block of a download
        # (progress bars; tests use it to break a download half-way).
        self.on_block: Callable[[str, int], None] | None = None

    # -- plumbing --------------------------------------------------------------------------
    def close(self) -> None:
        self._client.close()
        self._pool.close()

    def __enter__(self) -> "RemoteStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    def _backoff(self, attempt: int) -> None:
        # exponential with jitter, so many clients hitting a restarting server spread out
        time.sleep(min(0.25 * 2 ** attempt, 5.0) * (0.5 + random.random() / 2))

    def _fail(self, resp: httpx.Response, what: str):
        self._refused(resp.status_code, resp.reason_phrase, resp.content, what)

    def _refused(self, status: int, reason: str, content: bytes, what: str):
        try:
            body = json.loads(content)
            msg, hint = body.get("error") or reason, body.get("hint")
        except (ValueError, AttributeError):
            msg, hint = (content.decode("utf-8", "replace") or reason)[:200], None
        if status == 401:
            raise RemoteError(f"{self.url} refused {what}: {msg}", hint=TOKEN_HINT)
        if status == 404:
            raise NotFoundError(f"{msg} (on {self.url})", hint=hint)
        raise RemoteError(f"{self.url}: {what} failed with HTTP {status}: {msg}", hint=hint)

    def _send(self, method: str, path: str, **kw) -> httpx.Response:
        """One request with retries on connection errors and 5xx; other statuses returned."""
        for attempt in range(self.retries + 1):
            self._count("requests")
            try:
                resp = self._client.request(method, path, **kw)
                if resp.status_code < 500:
                    return resp
                err = f"HTTP {resp.status_code}"
            except httpx.UnsupportedProtocol as exc:
                raise RemoteError(f"{self.url}: {exc}") from None
            except httpx.TransportError as exc:
                err = f"{type(exc).__name__}: {exc}"
            if attempt == self.retries:
                raise RemoteError(f"{method} {self.url}{path} failed after {attempt + 1} attempt(s): {err}")
            self._count("retries")
            self._backoff(attempt)
        raise AssertionError("unreachable")

    def _json(self, path: str, what: str, params: dict | None = None, missing=...):
        resp = self._send("GET", path, params=params)
        if resp.status_code == 404 and missing is not ...:
            return missing
        if resp.status_code != 200:
            self._fail(resp, what)
        try:
            return resp.json()
        except ValueError:
            raise RemoteError(f"{self.url}{path} did not answer JSON (is this a kdnctl serve-files URL?)") from None

    # -- catalog reads (same signatures and results as Store) -------------------------------
    def get_document(self, doc_id: str, doc_version: str | None = None) -> DocumentRecord:
        params = {"doc_version": doc_version} if doc_version else None
        return _doc(self._json(f"/v1/docs/{_q(doc_id)}", f"document {doc_id!r}", params)["document"])

    def document_history(self, doc_id: str) -> list[DocumentRecord]:
        body = self._json(f"/v1/docs/{_q(doc_id)}", f"document {doc_id!r}", missing=None)
        return [_doc(d) for d in body["history"]] if body else []

    def find_document(self, doc_id: str, content_sha256: str) -> DocumentRecord | None:
        return next((d for d in self.document_history(doc_id) if d.content_sha256 == content_sha256), None)

    def list_documents(self) -> list[DocumentRecord]:
        return [_doc(e["document"]) for e in self._json("/v1/docs", "listing")["documents"]]

    def get_version(self, doc_id: str, label: str = "full", doc_version: str | None = None) -> VersionRecord:
        params = {"doc_version": doc_version} if doc_version else None
        path = f"/v1/docs/{_q(doc_id)}/versions/{_q(label)}"
        return self._learn(self._json(path, f"{doc_id!r} [{label}]", params))

    def list_versions(self, doc_id: str | None = None) -> list[VersionRecord]:
        if doc_id is not None:
            body = self._json(f"/v1/docs/{_q(doc_id)}/versions", f"versions of {doc_id!r}", missing=None)
            return [self._learn(v) for v in body["versions"]] if body else []
        body = self._json("/v1/docs", "listing", {"chunks": "1"})
        return [self._learn(v) for e in body["documents"] for v in e["versions"]]

    def _learn(self, raw) -> VersionRecord:
        """Decode a version record from the server, keeping what it says about its objects:
        BLAKE3 digests, sizes and (behind nginx with --signed-links) signed download links."""
        v = _version(raw)
        links = raw.get("links") if isinstance(raw, dict) else None
        if isinstance(links, dict):
            for c in v.chunks:
                q = links.get(c.object)
                m = _LINK.match(q) if isinstance(q, str) else None
                if m:
                    self._links[c.object] = (q, int(m.group(1)))
        for c in v.chunks:
            if c.blake3:
                self._blake3[c.object] = c.blake3
            if c.nbytes:
                self._nbytes[c.object] = c.nbytes
        return v

    def lookup_chunk(self, fingerprint: str, label: str, chain_hash: str) -> tuple[VersionRecord, ChunkRef] | None:
        path = f"/v1/chunks/{_q(fingerprint)}/{_q(label)}/{_q(chain_hash)}"
        body = self._json(path, "chunk lookup", missing=None)
        if body is None:
            return None
        if not isinstance(body, dict):
            raise RemoteError(f"{self.url}{path} answered {type(body).__name__}, not a chunk")
        return self._learn(body.get("version")), ChunkRef.from_dict(body.get("chunk"), "chunk from the server")

    def lookup_prefix(self, fingerprint: str, label: str, token_ids: list[int], chunk_tokens: int | None = None) -> dict:
        """The longest stored chain matching ``token_ids``, in one request (POST /v1/lookup)."""
        req = {"fingerprint": fingerprint, "label": label, "token_ids": [int(t) for t in token_ids]}
        if chunk_tokens:
            req["chunk_tokens"] = chunk_tokens
        resp = self._send("POST", "/v1/lookup", json=req)
        if resp.status_code != 200:
            self._fail(resp, "prefix lookup")
        return resp.json()

    def chunk_sizes(self) -> list[int]:
        return list(self._json("/v1/chunk-sizes", "chunk sizes")["chunk_sizes"])

    # -- objects -----------------------------------------------------------------------------
    def _check_sha(self, sha: str) -> None:
        check_sha(sha)

    def has_object(self, sha: str) -> bool:
        self._check_sha(sha)
        resp = self._send("HEAD", f"/v1/objects/{sha}")
        if resp.status_code == 404:
            return False
        if resp.status_code != 200:
            self._fail(resp, f"object {sha[:12]}")
        return True

    def _cache_path(self, sha: str) -> Path | None:
        return self.cache_dir / sha[:2] / sha if self.cache_dir else None

    def _from_cache(self, sha: str) -> bytearray | None:
        path = self._cache_path(sha)
        if path is None:
            return None
        try:
            data = read_into(path)
            check_bytes(data, sha, self._blake3.get(sha))
        except (OSError, StoreCorruptError):  # missing, or damaged: dropped and fetched again
            if path.exists():
                path.unlink(missing_ok=True)
            return None
        return data

    def _to_cache(self, sha: str, data: bytes) -> None:
        path = self._cache_path(sha)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f".{sha[:16]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, path)  # atomic: a reader sees no entry or the whole verified object
        except OSError:
            pass  # the cache is an optimisation; a full disk must not fail the load

    def _download(self, sha: str) -> tuple[bytearray, str, bool]:
        """Fetch an object, resuming after breaks; returns (bytes, their sha256, stitched?).

        The body lands in one preallocated buffer and each slice is hashed as it arrives
        (kdnctl/store/fetch.py): BLAKE3 when the version listing recorded one, else sha256."""
        b3 = self._blake3.get(sha)
        new_hasher = blake3_hasher if b3 and blake3_hasher() is not None else hashlib.sha256
        part = Partial(new_hasher, expect=self._nbytes.get(sha))
        plain = path = f"/v1/objects/{sha}"
        link = self._links.get(sha)
        if link and link[1] > time.time() + 5:  # a signed link: nginx checks it, kdnctl is not asked
            path = f"{plain}?{link[0]}"

        def on_bytes(n: int) -> None:
            self._count("bytes", n)
            if self.on_block is not None:
                self.on_block(sha, part.got)

        try:
            for attempt in range(self.retries + 1):
                self._count("requests")
                resumed = part.got > 0
                try:
                    try:
                        fetch_once(self._pool, path, self._headers, f'"{sha}"', part, on_bytes)
                    except Refused as exc:
                        if path == plain or exc.status not in (403, 410):
                            raise
                        self._links.pop(sha, None)  # expired, or the server restarted with a new secret
                        path = plain
                        fetch_once(self._pool, path, self._headers, f'"{sha}"', part, on_bytes)
                    if resumed and part.stitched:
                        self._count("resumed")
                    got = part.hasher.hexdigest()
                    if new_hasher is not hashlib.sha256:  # BLAKE3 checked: report it as the name
                        got = sha if got == b3 else f"blake3:{got}"
                    return part.buf, got, part.stitched
                except WrongSize as exc:
                    raise StoreCorruptError(f"object {sha[:12]} from {self.url}: {exc}; refused",
                                            hint="check the served store with `kdnctl verify`") from None
                except Refused as exc:
                    if exc.status == 404:
                        raise NotFoundError(f"object {sha[:12]} is not on {self.url} (missing there, "
                                            "or not visible to this token)") from None
                    self._refused(exc.status, exc.reason, exc.body, f"object {sha[:12]}")
                except (OSError, http.client.HTTPException, Retry) as exc:
                    err = f"{type(exc).__name__}: {exc}"
                if attempt == self.retries:
                    raise RemoteError(f"download of object {sha[:12]} from {self.url} failed after "
                                      f"{attempt + 1} attempt(s): {err}")
                self._count("retries")
                self._backoff(attempt)
            raise AssertionError("unreachable")
        finally:
            part.close()  # (a failed download's hash lane stops too)

    def read_object(self, sha: str, *, verify: bool = True) -> bytearray:
        """The verified bytes of object ``sha``, in a writable ``bytearray`` (the decoder makes
        zero-copy tensor views into it). ``verify`` is accepted for Store compatibility;
        remote bytes are always verified (the network and the server's disk are not trusted)."""
        self._check_sha(sha)
        data = self._from_cache(sha)
        if data is not None:
            self._count("cache_hits")
            return data
        data, got, stitched = self._download(sha)
        if got != sha and stitched:
            data, got, _ = self._download(sha)  # rule out a bad stitch: one clean download
        if got != sha:
            raise StoreCorruptError(
                f"object {sha[:12]} from {self.url} is corrupted: its {len(data)} bytes hash to {got[:12]}; refused",
                hint="the server's copy is damaged: run `kdnctl verify` on the served store and re-ingest",
            )
        self._to_cache(sha, data)
        return data

    def read_object_head(self, sha: str, n: int) -> bytes:
        """The first ``n`` bytes of an object; the whole object is fetched (and verified): a
        range request could not be checked against the object's hash."""
        return self.read_object(sha)[:n]

    def fetch_objects(self, shas: Iterable[str], max_workers: int | None = None) -> dict[str, bytearray]:
        """Download (and verify) several objects in parallel; the first failure is raised."""
        todo = list(dict.fromkeys(shas))
        for sha in todo:
            self._check_sha(sha)
        if not todo:
            return {}
        workers = min(max_workers or self.max_workers, len(todo))
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kdn-fetch") as pool:
            return dict(zip(todo, pool.map(self.read_object, todo)))


def mirror(remote: RemoteStore, store, doc_ids: list[str] | None = None, label: str | None = None,
           *, batch: int = 8, on_doc: Callable[[str, str], None] | None = None) -> dict:
    """Copy the current version of documents (all visible ones by default) from ``remote`` into
    the local ``store``: every label (or only ``label``) plus the document text.

    Objects are verified on download and written with Store.put_object before the catalog
    commit that refers to them, so an interrupted pull leaves only unreferenced objects."""
    report: dict = {"pulled": [], "unchanged": [], "skipped": [], "objects": 0, "bytes": 0}
    targets = list(doc_ids) if doc_ids else [d.doc_id for d in remote.list_documents()]
    with store.writer():
        for doc_id in targets:
            doc = remote.get_document(doc_id)
            if label:
                try:
                    versions = [remote.get_version(doc_id, label, doc.doc_version)]
                except NotFoundError:
                    if doc_ids:  # asked for by name: a missing label is an error
                        raise
                    report["skipped"].append({"doc_id": doc_id, "reason": f"no label {label!r}"})
                    continue
            else:
                # the doc may have changed on the server between the two requests: keep one version
                versions = [v for v in remote.list_versions(doc_id) if v.doc_version == doc.doc_version]
            # "full" first: commit_document needs one version, and derived labels name it as parent
            versions.sort(key=lambda v: (v.label != "full", v.label))
            if not versions:
                report["skipped"].append({"doc_id": doc_id, "reason": "no versions"})
                continue
            try:
                local = store.get_document(doc_id)
            except NotFoundError:
                local = None
            is_current = local is not None and local.doc_version == doc.doc_version
            todo = [v for v in versions if not (is_current and _same_version(store, v))]
            if not todo and is_current:
                report["unchanged"].append(doc_id)
                continue
            needed = [doc.text_object] + [c.object for v in versions for c in v.chunks]
            needed = [s for s in dict.fromkeys(needed) if not store.has_object(s)]
            for i in range(0, len(needed), batch):  # bounded memory: a batch at a time
                for sha, data in remote.fetch_objects(needed[i:i + batch]).items():
                    if store.put_object(data) != sha:  # cannot happen: read_object verified it
                        raise StoreCorruptError(f"object {sha[:12]} changed while being stored")
                    report["objects"] += 1
                    report["bytes"] += len(data)
            from kdnctl.store.bases import pull_bases

            report["objects"] += pull_bases(remote, store, [c.object for v in versions for c in v.chunks])
            from .maintenance import bundle_problems

            for v in todo:  # the server's records are checked against the (verified) bundles
                problems = bundle_problems(store, v)
                if problems:
                    raise StoreCorruptError(f"{remote.url} sent a version record that does not match its bundles: "
                                            f"{problems[0]}", hint="nothing was committed; check the served store "
                                            "with `kdnctl verify`")
            if not is_current:
                store.commit_document(doc, todo[0])
                todo = todo[1:]
            for v in todo:
                store.commit_version(v)
            report["pulled"].append(doc_id)
            if on_doc:
                on_doc(doc_id, "pulled")
    return report


def _same_version(store, v: VersionRecord) -> bool:
    try:
        mine = store.get_version(v.doc_id, v.label, v.doc_version)
    except NotFoundError:
        return False
    return [(c.index, c.object) for c in mine.chunks] == [(c.index, c.object) for c in v.chunks]
