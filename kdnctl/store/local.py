"""The local Store: content-addressed objects plus the LMDB catalog (layout: docs/bundle-format.md).

Invariants the code below protects (promises: docs/reliability.md):
- an object file, once visible under objects/, is complete (tmp write + fsync + rename);
- a catalog entry never points at an object that is missing (commits check first, in one txn);
- exactly one writer at a time (flock on write.lock); readers never take it;
- a store is created only in a missing or empty directory; a directory holding objects but no
  valid catalog is damaged and every operation refuses it (StoreCorruptError), writing nothing;
- every catalog record is validated when read (records.py); a bad one is a StoreCorruptError.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import socket
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import lmdb

from kdnctl.errors import KdnError, NotFoundError, StoreCorruptError, StoreLockedError, UsageError

from . import catalog as cat
from .catalog import DBS
from .records import CATALOG_HINT, SEP, ChunkRef, DocumentRecord, VersionRecord, check_id, check_sha, record_dict

LAYOUT = {"objects", "tmp", "catalog", "write.lock"}


def default_store_root() -> Path:
    return Path(os.environ.get("KDN_STORE", ".kdn"))


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


SUM_KEY = "_sum"  # per-record checksum: a flipped byte inside a record cannot read as another valid value


def _seal(record) -> bytes:
    d = record_dict(record)
    d[SUM_KEY] = hashlib.sha256(_dumps(d)).hexdigest()[:16]
    return _dumps(d)


def _unseal(raw: bytes, what: str) -> dict:
    d = json.loads(raw)
    if isinstance(d, dict) and SUM_KEY in d:  # records written before checksums have none
        want = d.pop(SUM_KEY)
        if hashlib.sha256(_dumps(d)).hexdigest()[:16] != want:
            raise StoreCorruptError(f"{what} fails its checksum (damaged bytes)", hint=CATALOG_HINT)
    return d


def _lookup_key(*parts: str) -> bytes | None:
    """A catalog key for a lookup, or None when no stored key can equal it (too long, NUL,
    not encodable): such an id is simply not in the store."""
    try:
        k = cat.key(*parts)
    except UnicodeEncodeError:
        return None
    if len(k) > 511 or any(SEP in p for p in parts):
        return None
    return k


def _show(k: bytes) -> str:
    return repr(k.replace(b"\x00", b"/"))[2:-1][:80]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def catalog_reads(fn: Callable) -> Callable:
    """Turn anything a damaged catalog can make LMDB or a decoder raise into StoreCorruptError."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kw):
        try:
            return fn(self, *args, **kw)
        except KdnError:
            raise
        except (lmdb.Error, UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError) as e:
            raise StoreCorruptError(f"catalog of {self.root} is damaged: {type(e).__name__}: {str(e)[:120]}",
                                    hint=CATALOG_HINT) from None

    return wrapper


class Store:
    def __init__(self, root: str | os.PathLike, *, create: bool = True):
        self.root = Path(root)
        self.objects_dir = self.root / "objects"
        self.tmp_dir = self.root / "tmp"
        self.catalog_dir = self.root / "catalog"
        self.lock_path = self.root / "write.lock"
        self._lock_fd: int | None = None
        self._lock_depth = 0
        self._closed = True
        if not (self.catalog_dir / "data.mdb").exists():
            self._create_or_refuse(create)
        self._env_key, self._env = cat.acquire_env(self.root, self.catalog_dir)
        self._closed = False
        try:
            self._db = cat.open_dbs(self.root, self._env)
        except BaseException:
            self.close()
            raise

    def _create_or_refuse(self, create: bool) -> None:
        """No catalog here: create a store if the directory is missing or empty, else refuse."""
        if self.root.exists() and not self.root.is_dir():
            raise UsageError(f"store path {self.root} is not a directory")
        entries = set(os.listdir(self.root)) if self.root.is_dir() else set()
        leftovers = {e for e in entries if e.startswith(".catalog-new-")}  # an interrupted create
        has_objects = self.objects_dir.is_dir() and any(p.is_file() for p in self.objects_dir.rglob("*"))
        if has_objects:
            raise cat._damaged(self.root, "it holds objects but no catalog (catalog/data.mdb is missing)")
        if entries - LAYOUT - leftovers:
            if create:
                raise UsageError(f"{self.root} is not empty and is not a kdnctl store; refusing to create one there",
                                 hint="pass --store with a new or empty directory")
            raise NotFoundError(f"no kdnctl store at {self.root}",
                                hint="point KDN_STORE/--store at an existing store")
        if not create:
            raise NotFoundError(f"no kdnctl store at {self.root}",
                                hint="run `kdnctl ingest` first, or point KDN_STORE/--store at an existing store")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            cat.create_catalog(self.catalog_dir)
            for d in (self.objects_dir, self.tmp_dir):
                d.mkdir(exist_ok=True)
        except OSError as e:
            raise UsageError(f"cannot create a store at {self.root}: {e.strerror or e}") from None

    # -- lifecycle / locking -------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the fd releases the flock
            self._lock_fd, self._lock_depth = None, 0
        cat.release_env(self._env_key)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def generation(self) -> int:
        """Changes whenever a write txn commits (LMDB's last txn id): a cheap cache key."""
        return int(self._env.info()["last_txnid"])

    @contextlib.contextmanager
    def writer(self) -> Iterator["Store"]:
        """Exclusive, non-blocking writer lock; re-entrant within this Store instance."""
        if self._lock_depth == 0:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
                os.close(fd)
                who = f" (pid {holder})" if holder else ""
                raise StoreLockedError(f"store {self.root} is locked by another writer{who}") from None
            # pid for diagnostics only: the flock, not the file content, is the lock.
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
            self._lock_fd = fd
        self._lock_depth += 1
        try:
            yield self
        finally:
            self._lock_depth -= 1
            if self._lock_depth == 0 and self._lock_fd is not None:
                fd, self._lock_fd = self._lock_fd, None
                os.ftruncate(fd, 0)
                os.close(fd)

    def _require_writer(self, what: str) -> None:
        if self._lock_depth == 0:
            raise StoreLockedError(f"{what} requires the store's writer lock",
                                   hint="wrap the write in `with store.writer():`")

    # -- objects ---------------------------------------------------------------------------
    def object_path(self, sha: str) -> Path:
        check_sha(sha)  # also keeps a hostile id like "../x" from escaping the store
        return self.objects_dir / sha[:2] / sha

    def has_object(self, sha: str) -> bool:
        return self.object_path(sha).is_file()

    def put_object(self, data: bytes) -> str:
        data = bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        final = self.object_path(sha)
        # Idempotent; but a damaged copy of the same content is replaced, not trusted.
        if final.is_file() and hash_file(final) == sha:
            return sha
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        # host and pid in the name let gc tell a dead writer's leftovers from a live write
        tmp = self.tmp_dir / f"{sha[:16]}.{socket.gethostname()[:32]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if not final.parent.is_dir():
                final.parent.mkdir(parents=True, exist_ok=True)
                _fsync_dir(self.objects_dir)  # make the new fan-out dir entry durable
            os.rename(tmp, final)  # atomic: readers see nothing or the whole object
            _fsync_dir(final.parent)  # make the rename durable before any commit refers to it
        finally:
            tmp.unlink(missing_ok=True)
        return sha

    def read_object(self, sha: str, *, verify: bool = True) -> bytes:
        path = self.object_path(sha)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StoreCorruptError(f"object {sha[:12]} is missing from {self.objects_dir}") from None
        if verify and hashlib.sha256(data).hexdigest() != sha:
            raise StoreCorruptError(f"object {sha[:12]} is corrupted (its bytes no longer match its hash)")
        return data

    def read_object_head(self, sha: str, n: int) -> bytes:
        """The first ``n`` bytes of an object (bundle headers), unverified: callers that act on
        them check them against something already verified (the catalog record)."""
        try:
            with open(self.object_path(sha), "rb") as f:
                return f.read(n)
        except FileNotFoundError:
            raise StoreCorruptError(f"object {sha[:12]} is missing from {self.objects_dir}") from None

    # -- commits ---------------------------------------------------------------------------
    def _check_objects(self, shas: list[str], what: str) -> None:
        missing = [s for s in shas if not self.has_object(s)]
        if missing:
            listed = ", ".join(s[:12] for s in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise StoreCorruptError(
                f"refusing to commit {what}: {len(missing)} referenced object(s) missing ({listed})",
                hint="put_object every chunk and text before committing",
            )

    def _put_version(self, txn, v: VersionRecord, now: float) -> None:
        vkey = cat.key(v.doc_id, v.doc_version, v.label)
        old = txn.get(vkey, db=self._db["versions"])
        if old is not None:  # re-commit of a label: drop the old prefix entries first
            o = self._version(vkey, old)
            for c in o.chunks:
                txn.delete(cat.key(o.fingerprint, o.label, c.chain_hash, o.doc_id, o.doc_version), db=self._db["prefix"])
            # objects the new record no longer uses stay for gc's grace period (readers may hold them)
            for sha in {c.object for c in o.chunks} - {c.object for c in v.chunks}:
                txn.put(cat.key("released", sha), _dumps({"created": now}), db=self._db["meta"])
        txn.put(vkey, _seal(v), db=self._db["versions"])
        for c in v.chunks:
            pkey = cat.key(v.fingerprint, v.label, c.chain_hash, v.doc_id, v.doc_version)
            txn.put(pkey, _dumps({"index": c.index}), db=self._db["prefix"])

    @staticmethod
    def _check_new(cls, record) -> None:
        try:  # the same schema a read enforces: nothing a read would refuse is ever written
            cls.from_dict(record_dict(record), f"new {cls.__name__}")
        except StoreCorruptError as e:
            raise UsageError(e.message) from None

    def _check_version_record(self, v: VersionRecord) -> None:
        self._check_new(VersionRecord, v)
        for kind in ("doc_id", "doc_version", "label"):
            check_id(kind, getattr(v, kind))

    def commit_document(self, doc: DocumentRecord, version: VersionRecord) -> None:
        """Record a document version (made current) and its first label, in one txn."""
        import time

        self._require_writer("commit_document")
        check_id("doc_id", doc.doc_id)
        check_id("doc_version", doc.doc_version)
        self._check_new(DocumentRecord, doc)
        self._check_version_record(version)
        if (version.doc_id, version.doc_version) != (doc.doc_id, doc.doc_version):
            raise UsageError("commit_document: the version belongs to a different document version")
        self._check_objects([doc.text_object] + [c.object for c in version.chunks], f"document {doc.doc_id}")
        now = time.time()
        with self._env.begin(write=True) as txn:
            prev = self._current(txn, doc.doc_id)
            if prev is not None and prev != doc.doc_version:  # superseded now: gc's grace starts
                txn.put(cat.key("retired", doc.doc_id, prev), _dumps({"created": now}), db=self._db["meta"])
            txn.delete(cat.key("retired", doc.doc_id, doc.doc_version), db=self._db["meta"])
            txn.put(cat.key(doc.doc_id, doc.doc_version), _seal(doc), db=self._db["docs"])
            txn.put(cat.key(doc.doc_id), _dumps(doc.doc_version), db=self._db["current"])
            self._put_version(txn, version, now)

    def commit_version(self, version: VersionRecord) -> None:
        """Add (or replace) a label of an existing document version, in one txn."""
        import time

        self._require_writer("commit_version")
        self._check_version_record(version)
        self._check_objects([c.object for c in version.chunks], f"version {version.doc_id}/{version.label}")
        with self._env.begin(write=True) as txn:
            if txn.get(cat.key(version.doc_id, version.doc_version), db=self._db["docs"]) is None:
                raise NotFoundError(f"document {version.doc_id} version {version.doc_version} is not in the store")
            self._put_version(txn, version, time.time())

    def remove_document(self, doc_id: str) -> None:
        """Forget a document: it stops being current; `gc` then reclaims its data after the grace period."""
        import time

        self._require_writer("remove_document")
        k = _lookup_key(doc_id)
        with self._env.begin(write=True) as txn:
            prev = self._current(txn, doc_id) if k is not None else None
            if prev is None:
                raise NotFoundError(f"document {doc_id!r} is not in the store")
            txn.delete(k, db=self._db["current"])
            txn.put(cat.key("retired", doc_id, prev), _dumps({"created": time.time()}), db=self._db["meta"])

    # -- record decoding (every read goes through these) --------------------------------------
    def _doc(self, k: bytes, raw: bytes) -> DocumentRecord:
        d = DocumentRecord.from_dict(_unseal(raw, f"document record {_show(k)}"), "document record")
        if cat.key(d.doc_id, d.doc_version) != k:
            raise StoreCorruptError(f"document record {d.doc_id}@{d.doc_version} is stored under another key",
                                    hint=CATALOG_HINT)
        return d

    def _version(self, k: bytes, raw: bytes) -> VersionRecord:
        v = VersionRecord.from_dict(_unseal(raw, f"version record {_show(k)}"), "version record")
        if cat.key(v.doc_id, v.doc_version, v.label) != k:
            raise StoreCorruptError(f"version record {v.doc_id}@{v.doc_version}/{v.label} is stored under another key",
                                    hint=CATALOG_HINT)
        return v

    def _current(self, txn, doc_id: str) -> str | None:
        k = _lookup_key(doc_id)
        raw = txn.get(k, db=self._db["current"]) if k is not None else None
        if raw is None:
            return None
        dv = json.loads(raw)
        if not isinstance(dv, str) or not dv:
            raise StoreCorruptError(f"current-version entry of {doc_id!r} is {str(dv)[:40]!r}", hint=CATALOG_HINT)
        return dv

    def _scan(self, txn, db: str, *prefix: str) -> Iterator[tuple[bytes, bytes]]:
        if prefix:
            p = _lookup_key(*prefix)
            if p is None:
                return
            p += SEP.encode()
        else:
            p = b""
        cur = txn.cursor(db=self._db[db])
        if not cur.set_range(p):
            return
        for k, v in cur:
            if not k.startswith(p):
                break
            yield k, v

    # -- reads -----------------------------------------------------------------------------
    @catalog_reads
    def get_document(self, doc_id: str, doc_version: str | None = None) -> DocumentRecord:
        with self._env.begin() as txn:
            dv = doc_version or self._current(txn, doc_id)
            k = _lookup_key(doc_id, dv) if dv else None
            raw = txn.get(k, db=self._db["docs"]) if k is not None else None
            if raw is None:
                if dv and not doc_version:
                    raise StoreCorruptError(f"current version of {doc_id!r} points at a missing document record",
                                            hint=CATALOG_HINT)
                what = f"document {doc_id!r}" + (f" version {doc_version}" if doc_version else "")
                raise NotFoundError(f"{what} is not in the store")
            return self._doc(k, raw)

    def find_document(self, doc_id: str, content_sha256: str) -> DocumentRecord | None:
        """The stored version of doc_id with this content (lets ingest skip unchanged files)."""
        return next((d for d in self.document_history(doc_id) if d.content_sha256 == content_sha256), None)

    @catalog_reads
    def list_documents(self) -> list[DocumentRecord]:
        with self._env.begin() as txn:
            out = []
            for k, _ in self._scan(txn, "current"):
                doc_id = cat.split(k)[0]
                dv = self._current(txn, doc_id)
                dk = cat.key(doc_id, dv)
                raw = txn.get(dk, db=self._db["docs"])
                if raw is None:  # never skipped silently: a listing must not hide a document
                    raise StoreCorruptError(f"current version of {doc_id!r} points at a missing document record",
                                            hint=CATALOG_HINT)
                out.append(self._doc(dk, raw))
        return out

    @catalog_reads
    def document_history(self, doc_id: str) -> list[DocumentRecord]:
        with self._env.begin() as txn:
            docs = [self._doc(k, v) for k, v in self._scan(txn, "docs", doc_id)]
        return sorted(docs, key=lambda d: (d.created, d.doc_version))

    @catalog_reads
    def get_version(self, doc_id: str, label: str = "full", doc_version: str | None = None) -> VersionRecord:
        with self._env.begin() as txn:
            dv = doc_version or self._current(txn, doc_id)
            dk = _lookup_key(doc_id, dv) if dv else None
            if dk is None or txn.get(dk, db=self._db["docs"]) is None:
                raise NotFoundError(f"document {doc_id!r}" + (f" version {doc_version}" if doc_version else "")
                                    + " is not in the store")
            vk = _lookup_key(doc_id, dv, label)
            raw = txn.get(vk, db=self._db["versions"]) if vk is not None else None
            if raw is None:
                labels = [cat.split(k)[2] for k, _ in self._scan(txn, "versions", doc_id, dv)]
                raise NotFoundError(
                    f"document {doc_id!r} has no version labelled {label!r}",
                    hint=f"labels stored for {doc_id}: {', '.join(labels) or '(none)'}",
                )
            return self._version(vk, raw)

    @catalog_reads
    def list_versions(self, doc_id: str | None = None) -> list[VersionRecord]:
        """Labels of the current document versions (of one document, or of all)."""
        with self._env.begin() as txn:
            ids = [doc_id] if doc_id is not None else [cat.split(k)[0] for k, _ in self._scan(txn, "current")]
            out = []
            for d in ids:
                dv = self._current(txn, d)
                if dv is not None:
                    out.extend(self._version(k, v) for k, v in self._scan(txn, "versions", d, dv))
        return out

    @catalog_reads
    def lookup_chunk(self, fingerprint: str, label: str, chain_hash: str) -> tuple[VersionRecord, ChunkRef] | None:
        """A stored chunk with this (model, label, chain hash), preferring current documents."""
        hits = self.chunk_hits(fingerprint, label, chain_hash)
        return hits[0] if hits else None

    @catalog_reads
    def chunk_hits(self, fingerprint: str, label: str, chain_hash: str,
                   visible: Callable[[str], bool] | None = None) -> list[tuple[VersionRecord, ChunkRef]]:
        """Every stored chunk with this (model, label, chain hash) whose doc id passes
        ``visible`` (checked on the KEY, before any record is read: an invisible hit costs the
        same as no hit), current documents first."""
        out: list[tuple[int, VersionRecord, ChunkRef]] = []
        with self._env.begin() as txn:
            for k, v in self._scan(txn, "prefix", fingerprint, label, chain_hash):
                doc_id, dv = cat.split(k)[3:5]
                if visible is not None and not visible(doc_id):
                    continue
                vk = cat.key(doc_id, dv, label)
                raw = txn.get(vk, db=self._db["versions"])
                if raw is None:
                    continue  # superseded entry that gc has not dropped yet; verify reports dangling ones
                rec = self._version(vk, raw)
                entry = json.loads(v)
                c = rec.chunk(entry["index"]) if isinstance(entry, dict) else None
                if c is None or c.chain_hash != chain_hash:
                    continue
                out.append((0 if self._current(txn, doc_id) == dv else 1, rec, c))
        out.sort(key=lambda e: e[0])
        return [(rec, c) for _, rec, c in out]

    def chunk_sizes(self) -> list[int]:
        """Distinct chunk lengths of current versions, for prefix lookups that must re-hash a
        prompt with each chunking the store holds."""
        return chunk_sizes_of(self.list_versions())

    # -- maintenance (maintenance.py) ---------------------------------------------------------
    def verify_report(self, *, check_bundles: bool = True):
        from .maintenance import verify_store

        return verify_store(self, check_bundles=check_bundles)

    def verify(self) -> list[str]:
        return self.verify_report().problems

    def gc(self, *, dry_run: bool = False, grace_s: float | None = None, tmp_grace_s: float | None = None) -> dict:
        from .maintenance import collect_garbage

        return collect_garbage(self, dry_run=dry_run, grace_s=grace_s, tmp_grace_s=tmp_grace_s)

    @catalog_reads
    def catalog_dump(self) -> dict:
        """Every catalog entry, keys joined with '/', `created` removed: equal for equal stores."""
        out: dict[str, dict] = {}
        with self._env.begin() as txn:
            for db in DBS:
                entries = {}
                for k, v in self._scan(txn, db):
                    val = json.loads(v)
                    if isinstance(val, dict):
                        val.pop("created", None)
                        val.pop(SUM_KEY, None)
                    entries["/".join(cat.split(k))] = val
                out[db] = dict(sorted(entries.items()))
        return out


def chunk_sizes_of(versions) -> list[int]:
    sizes = set()
    for v in versions:
        n = v.recipe.get("chunk_tokens") if isinstance(v.recipe, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            sizes.add(n)
        elif v.chunks:
            sizes.add(v.chunks[0].token_end - v.chunks[0].token_start)
    return sorted(sizes)
