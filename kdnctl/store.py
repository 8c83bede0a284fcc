"""Content-addressed object store plus an LMDB catalog (layout in docs/bundle-format.md).

Invariants the code below protects:
- an object file, once visible under objects/, is complete (tmp write + fsync + rename);
- a catalog entry never points at an object that is missing (commits check first, in one txn);
- exactly one writer at a time (flock on write.lock); readers never take it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import lmdb

from kdnctl.errors import NotFoundError, StoreCorruptError, StoreLockedError, UnsupportedError, UsageError

SCHEMA_VERSION = 1
MAP_SIZE = 1 << 30  # virtual reservation only: data.mdb grows with use (sparse on Linux)
DBS = ("meta", "docs", "current", "versions", "prefix")
SEP = "\x00"  # key separator; ids are checked not to contain it
TMP_GRACE_S = 600.0  # gc leaves younger tmp files alone: they may be a live put_object
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_MAX_ID_BYTES = {"doc_id": 200, "doc_version": 64, "label": 64}  # LMDB keys are <= 511 bytes


def default_store_root() -> Path:
    return Path(os.environ.get("KDN_STORE", ".kdn"))


@dataclass
class ChunkRef:
    index: int
    object: str
    token_start: int
    token_end: int
    chain_hash: str
    nbytes: int
    # BLAKE3 of the object's bytes, recorded at write time beside its sha256 name (issue 15): a
    # reader that has it checks every byte at BLAKE3 speed; older catalogs simply lack it.
    blake3: str | None = None


@dataclass
class DocumentRecord:
    doc_id: str
    doc_version: str
    content_sha256: str
    source: str
    n_tokens: int
    fingerprint: str
    text_object: str
    created: float


@dataclass
class VersionRecord:
    doc_id: str
    doc_version: str
    label: str
    parent: str | None
    recipe: dict
    fingerprint: str
    chunks: list[ChunkRef]
    created: float
    n_tokens: int
    mode: str = "prefix"

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)  # anything that makes data unusable
    info: list[str] = field(default_factory=list)  # harmless findings (orphans, tmp files)
    n_objects: int = 0
    n_bytes: int = 0


# -- (de)serialisation ------------------------------------------------------------------

def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _known(cls, d: dict) -> dict:
    # Ignore fields a newer kdnctl may have added (schema changes are additive).
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


def _doc_from(raw: bytes) -> DocumentRecord:
    return DocumentRecord(**_known(DocumentRecord, json.loads(raw)))


def _version_from(raw: bytes) -> VersionRecord:
    d = _known(VersionRecord, json.loads(raw))
    d["chunks"] = [ChunkRef(**_known(ChunkRef, c)) for c in d.get("chunks", [])]
    return VersionRecord(**d)


def _chunk(rec: VersionRecord, index: int) -> ChunkRef | None:
    return next((c for c in rec.chunks if c.index == index), None)


def _key(*parts: str) -> bytes:
    key = SEP.join(parts).encode("utf-8")
    if len(key) > 511:  # LMDB's key limit; writes check ids first, so only a lookup gets here
        raise NotFoundError(f"{parts[0][:40]!r}... is not in the store (id too long)")
    return key


def _split(key: bytes) -> list[str]:
    return key.decode("utf-8").split(SEP)


def _check_id(kind: str, value: str) -> None:
    if not isinstance(value, str) or not value or SEP in value:
        raise UsageError(f"invalid {kind} {value!r}: must be a non-empty string without NUL")
    if len(value.encode("utf-8")) > _MAX_ID_BYTES[kind]:
        raise UsageError(f"{kind} {value[:40]!r}... is longer than {_MAX_ID_BYTES[kind]} bytes")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# LMDB forbids opening one environment twice in a process, so Store instances on the same
# root share one Environment (refcounted). The write lock stays per instance (own fd).
_ENVS: dict[str, list] = {}
_ENVS_LOCK = threading.Lock()


def _acquire_env(key: str) -> lmdb.Environment:
    with _ENVS_LOCK:
        if key not in _ENVS:
            env = lmdb.open(key, subdir=True, map_size=MAP_SIZE, max_dbs=8, lock=True)
            _ENVS[key] = [env, 0]
        _ENVS[key][1] += 1
        return _ENVS[key][0]


def _release_env(key: str) -> None:
    with _ENVS_LOCK:
        entry = _ENVS.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                entry[0].close()
                del _ENVS[key]


class Store:
    def __init__(self, root: str | os.PathLike, *, create: bool = True):
        self.root = Path(root)
        self.objects_dir = self.root / "objects"
        self.tmp_dir = self.root / "tmp"
        self.catalog_dir = self.root / "catalog"
        self.lock_path = self.root / "write.lock"
        if not (self.catalog_dir / "data.mdb").exists():
            if not create:
                raise NotFoundError(
                    f"no kdnctl store at {self.root}",
                    hint="run `kdnctl ingest` first, or point KDN_STORE/--store at an existing store",
                )
            for d in (self.objects_dir, self.tmp_dir, self.catalog_dir):
                d.mkdir(parents=True, exist_ok=True)
        self._lock_fd: int | None = None
        self._lock_depth = 0
        self._blake3_of: dict[str, str] = {}  # sha256 -> BLAKE3 of objects written by this process
        try:
            # the key is fixed now: a later chdir must not make close() miss the entry
            self._env_key = str(self.catalog_dir.resolve())
            self._env = _acquire_env(self._env_key)
        except lmdb.Error as e:
            raise StoreCorruptError(f"catalog {self.catalog_dir} cannot be opened: {e}") from None
        self._closed = False
        try:
            # open_db creates missing databases (a short LMDB write txn; LMDB serialises those).
            self._db = {name: self._env.open_db(name.encode()) for name in DBS}
            with self._env.begin(write=True) as txn:
                raw = txn.get(b"schema_version", db=self._db["meta"])
                if raw is None:
                    txn.put(b"schema_version", _dumps(SCHEMA_VERSION), db=self._db["meta"])
        except lmdb.Error as e:
            self.close()
            raise StoreCorruptError(f"catalog {self.catalog_dir} cannot be opened: {e}") from None
        if raw is not None and json.loads(raw) != SCHEMA_VERSION:
            self.close()
            raise UnsupportedError(
                f"store {self.root} has catalog schema {json.loads(raw)}; this kdnctl reads schema {SCHEMA_VERSION}"
            )

    # -- lifecycle / locking -------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the fd releases the flock
            self._lock_fd, self._lock_depth = None, 0
        _release_env(self._env_key)

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        if not isinstance(sha, str) or not _SHA_RE.match(sha):
            # also keeps a hostile id like "../x" from escaping the store
            raise UsageError(f"invalid object id {str(sha)[:80]!r}: expected 64 lowercase hex chars")
        return self.objects_dir / sha[:2] / sha

    def has_object(self, sha: str) -> bool:
        return self.object_path(sha).is_file()

    def put_object(self, data: bytes) -> str:
        data = bytes(data)
        sha = hashlib.sha256(data).hexdigest()
        self._remember_blake3(sha, data)
        final = self.object_path(sha)
        # Idempotent; but a damaged copy of the same content is replaced, not trusted.
        if final.is_file() and _hash_file(final) == sha:
            return sha
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.tmp_dir / f"{sha[:16]}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
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

    def _remember_blake3(self, sha: str, data: bytes) -> None:
        from .fastread import blake3_hex

        digest = blake3_hex(data)
        if digest is not None:
            self._blake3_of[sha] = digest

    def read_object_checked(self, sha: str, blake3: str | None = None) -> bytearray:
        """The object's bytes in one writable buffer (zero-copy tensor views can point into
        it), every byte checked before return: against ``blake3`` when the catalog recorded it
        (several GB/s), else against the sha256 name."""
        from .fastread import read_verified

        return read_verified(self.object_path(sha), sha, blake3)

    def read_object(self, sha: str, *, verify: bool = True) -> bytes:
        path = self.object_path(sha)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StoreCorruptError(f"object {sha[:12]} is missing from {self.objects_dir}") from None
        if verify and hashlib.sha256(data).hexdigest() != sha:
            raise StoreCorruptError(f"object {sha[:12]} is corrupted (its bytes no longer match its hash)")
        return data

    # -- commits ---------------------------------------------------------------------------
    def _check_objects(self, shas: list[str], what: str) -> None:
        missing = [s for s in shas if not self.has_object(s)]
        if missing:
            listed = ", ".join(s[:12] for s in missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise StoreCorruptError(
                f"refusing to commit {what}: {len(missing)} referenced object(s) missing ({listed})",
                hint="put_object every chunk and text before committing",
            )

    def _put_version(self, txn, v: VersionRecord) -> None:
        vkey = _key(v.doc_id, v.doc_version, v.label)
        old = txn.get(vkey, db=self._db["versions"])
        if old is not None:  # re-commit of a label: drop the old prefix entries first
            o = _version_from(old)
            for c in o.chunks:
                txn.delete(_key(o.fingerprint, o.label, c.chain_hash, o.doc_id, o.doc_version), db=self._db["prefix"])
        for c in v.chunks:  # fast-read digests of objects this process wrote (see fastread.py)
            if c.blake3 is None:
                c.blake3 = self._blake3_of.get(c.object)
        txn.put(vkey, _dumps(dataclasses.asdict(v)), db=self._db["versions"])
        for c in v.chunks:
            pkey = _key(v.fingerprint, v.label, c.chain_hash, v.doc_id, v.doc_version)
            txn.put(pkey, _dumps({"index": c.index}), db=self._db["prefix"])

    def _check_version_record(self, v: VersionRecord) -> None:
        for kind in ("doc_id", "doc_version", "label"):
            _check_id(kind, getattr(v, kind))
        if len({c.index for c in v.chunks}) != len(v.chunks):
            raise UsageError(f"version {v.doc_id}/{v.label}: duplicate chunk indices")

    def commit_document(self, doc: DocumentRecord, version: VersionRecord) -> None:
        """Record a document version (made current) and its first label, in one txn."""
        self._require_writer("commit_document")
        _check_id("doc_id", doc.doc_id)
        _check_id("doc_version", doc.doc_version)
        self._check_version_record(version)
        if (version.doc_id, version.doc_version) != (doc.doc_id, doc.doc_version):
            raise UsageError("commit_document: the version belongs to a different document version")
        self._check_objects([doc.text_object] + [c.object for c in version.chunks], f"document {doc.doc_id}")
        with self._env.begin(write=True) as txn:
            txn.put(_key(doc.doc_id, doc.doc_version), _dumps(dataclasses.asdict(doc)), db=self._db["docs"])
            txn.put(_key(doc.doc_id), _dumps(doc.doc_version), db=self._db["current"])
            self._put_version(txn, version)

    def commit_version(self, version: VersionRecord) -> None:
        """Add (or replace) a label of an existing document version, in one txn."""
        self._require_writer("commit_version")
        self._check_version_record(version)
        self._check_objects([c.object for c in version.chunks], f"version {version.doc_id}/{version.label}")
        with self._env.begin(write=True) as txn:
            if txn.get(_key(version.doc_id, version.doc_version), db=self._db["docs"]) is None:
                raise NotFoundError(f"document {version.doc_id} version {version.doc_version} is not in the store")
            self._put_version(txn, version)

    def remove_document(self, doc_id: str) -> None:
        """Forget a document: it stops being current; `gc` then reclaims its data."""
        self._require_writer("remove_document")
        with self._env.begin(write=True) as txn:
            if not txn.delete(_key(doc_id), db=self._db["current"]):
                raise NotFoundError(f"document {doc_id!r} is not in the store")

    # -- reads -----------------------------------------------------------------------------
    def _scan(self, txn, db: str, *prefix: str) -> Iterator[tuple[bytes, bytes]]:
        p = _key(*prefix) + SEP.encode() if prefix else b""
        cur = txn.cursor(db=self._db[db])
        if not cur.set_range(p):
            return
        for k, v in cur:
            if not k.startswith(p):
                break
            yield k, v

    def _current(self, txn, doc_id: str) -> str | None:
        raw = txn.get(_key(doc_id), db=self._db["current"])
        return json.loads(raw) if raw is not None else None

    def get_document(self, doc_id: str, doc_version: str | None = None) -> DocumentRecord:
        with self._env.begin() as txn:
            dv = doc_version or self._current(txn, doc_id)
            raw = txn.get(_key(doc_id, dv), db=self._db["docs"]) if dv else None
        if raw is None:
            what = f"document {doc_id!r}" + (f" version {doc_version}" if doc_version else "")
            raise NotFoundError(f"{what} is not in the store")
        return _doc_from(raw)

    def find_document(self, doc_id: str, content_sha256: str) -> DocumentRecord | None:
        """The stored version of doc_id with this content (lets ingest skip unchanged files)."""
        return next((d for d in self.document_history(doc_id) if d.content_sha256 == content_sha256), None)

    def list_documents(self) -> list[DocumentRecord]:
        with self._env.begin() as txn:
            out = []
            for k, v in self._scan(txn, "current"):
                raw = txn.get(_key(_split(k)[0], json.loads(v)), db=self._db["docs"])
                if raw is not None:
                    out.append(_doc_from(raw))
        return out

    def document_history(self, doc_id: str) -> list[DocumentRecord]:
        with self._env.begin() as txn:
            docs = [_doc_from(v) for _, v in self._scan(txn, "docs", doc_id)]
        return sorted(docs, key=lambda d: (d.created, d.doc_version))

    def get_version(self, doc_id: str, label: str = "full", doc_version: str | None = None) -> VersionRecord:
        with self._env.begin() as txn:
            dv = doc_version or self._current(txn, doc_id)
            if dv is None or txn.get(_key(doc_id, dv), db=self._db["docs"]) is None:
                raise NotFoundError(f"document {doc_id!r}" + (f" version {doc_version}" if doc_version else "") + " is not in the store")
            raw = txn.get(_key(doc_id, dv, label), db=self._db["versions"])
            if raw is None:
                labels = [_split(k)[2] for k, _ in self._scan(txn, "versions", doc_id, dv)]
                raise NotFoundError(
                    f"document {doc_id!r} has no version labelled {label!r}",
                    hint=f"labels stored for {doc_id}: {', '.join(labels) or '(none)'}",
                )
        return _version_from(raw)

    def list_versions(self, doc_id: str | None = None) -> list[VersionRecord]:
        """Labels of the current document versions (of one document, or of all)."""
        with self._env.begin() as txn:
            ids = [doc_id] if doc_id is not None else [_split(k)[0] for k, _ in self._scan(txn, "current")]
            out = []
            for d in ids:
                dv = self._current(txn, d)
                if dv is not None:
                    out.extend(_version_from(v) for _, v in self._scan(txn, "versions", d, dv))
        return out

    def lookup_chunk(self, fingerprint: str, label: str, chain_hash: str) -> tuple[VersionRecord, ChunkRef] | None:
        """A stored chunk with this (model, label, chain hash), preferring current documents."""
        with self._env.begin() as txn:
            fallback = None
            for k, v in self._scan(txn, "prefix", fingerprint, label, chain_hash):
                doc_id, dv = _split(k)[3:5]
                raw = txn.get(_key(doc_id, dv, label), db=self._db["versions"])
                if raw is None:
                    continue  # dangling entry; verify reports it, gc removes it
                rec = _version_from(raw)
                idx = json.loads(v)["index"]
                c = _chunk(rec, idx)
                if c is None or c.chain_hash != chain_hash:
                    continue
                if self._current(txn, doc_id) == dv:
                    return rec, c
                fallback = fallback or (rec, c)
        return fallback

    def chunk_sizes(self) -> list[int]:
        """Distinct chunk lengths (recipe["chunk_tokens"]) of current versions, for prefix lookups
        that must re-hash a prompt with each chunking the store holds."""
        sizes = set()
        for v in self.list_versions():
            n = v.recipe.get("chunk_tokens") if isinstance(v.recipe, dict) else None
            if isinstance(n, int) and n > 0:
                sizes.add(n)
            elif v.chunks:
                sizes.add(v.chunks[0].token_end - v.chunks[0].token_start)
        return sorted(sizes)

    # -- maintenance -------------------------------------------------------------------------
    def _object_files(self) -> Iterator[Path]:
        if self.objects_dir.is_dir():
            for sub in sorted(self.objects_dir.iterdir()):
                if sub.is_dir():
                    yield from sorted(p for p in sub.iterdir() if p.is_file())

    def _references(self, txn) -> dict[str, list[str]]:
        """object sha -> human descriptions of what refers to it."""
        refs: dict[str, list[str]] = {}
        for _, v in self._scan(txn, "docs"):
            d = _doc_from(v)
            refs.setdefault(d.text_object, []).append(f"text of {d.doc_id}@{d.doc_version}")
        for _, v in self._scan(txn, "versions"):
            r = _version_from(v)
            for c in r.chunks:
                refs.setdefault(c.object, []).append(f"{r.doc_id}@{r.doc_version}/{r.label} chunk {c.index}")
        return refs

    def verify_report(self) -> VerifyReport:
        rep = VerifyReport()
        with self._env.begin() as txn:
            refs = self._references(txn)
            docs = {tuple(_split(k)) for k, _ in self._scan(txn, "docs")}
            for k, v in self._scan(txn, "current"):
                if (_split(k)[0], json.loads(v)) not in docs:
                    rep.problems.append(f"current version of {_split(k)[0]} points at a missing document record")
            versions: dict[tuple, VersionRecord] = {}
            for k, v in self._scan(txn, "versions"):
                r = _version_from(v)
                versions[tuple(_split(k))] = r
                if (r.doc_id, r.doc_version) not in docs:
                    rep.problems.append(f"version {r.doc_id}@{r.doc_version}/{r.label} has no document record")
            for k, v in self._scan(txn, "prefix"):
                fp, label, chain, doc_id, dv = _split(k)
                r, idx = versions.get((doc_id, dv, label)), json.loads(v)["index"]
                c = _chunk(r, idx) if r is not None else None
                if c is None or c.chain_hash != chain:
                    rep.problems.append(f"dangling prefix entry {chain[:12]} -> {doc_id}@{dv}/{label} chunk {idx}")
        present: set[str] = set()
        for p in self._object_files():
            if not _SHA_RE.match(p.name) or p.parent.name != p.name[:2]:
                rep.info.append(f"unexpected file in objects/: {p.relative_to(self.root)}")
                continue
            present.add(p.name)
            rep.n_objects += 1
            rep.n_bytes += p.stat().st_size
            if _hash_file(p) != p.name:
                used = refs.get(p.name)
                where = f"used by {'; '.join(used[:3])}" if used else "unreferenced"
                rep.problems.append(f"object {p.name[:12]} is corrupted (hash mismatch), {where}")
        for sha, used in sorted(refs.items()):
            if sha not in present:
                rep.problems.append(f"object {sha[:12]} is missing, used by {'; '.join(used[:3])}")
        orphans = len(present - set(refs))
        if orphans:
            rep.info.append(f"{orphans} unreferenced object(s) (`kdnctl gc` removes them)")
        tmps = list(self.tmp_dir.iterdir()) if self.tmp_dir.is_dir() else []
        if tmps:
            rep.info.append(f"{len(tmps)} temp file(s) in tmp/ (interrupted writes; `kdnctl gc` removes stale ones)")
        return rep

    def verify(self) -> list[str]:
        return self.verify_report().problems

    def gc(self, *, dry_run: bool = False, tmp_grace_s: float = TMP_GRACE_S) -> dict:
        """Drop superseded doc versions, then unreferenced objects and stale tmp files.

        Holds the writer lock so no writer can be between put_object and commit while
        unreferenced objects are deleted (their objects would look like garbage).
        """
        with self.writer():
            names = ("doc_versions_removed", "versions_removed", "prefix_entries_removed",
                     "objects_removed", "tmp_removed", "bytes_freed")
            stats: dict[str, Any] = {"dry_run": dry_run, **dict.fromkeys(names, 0)}
            refs: set[str] = set()  # objects referenced once this txn is done
            with self._env.begin(write=not dry_run) as txn:

                def drop(db: str, key: bytes, counter: str) -> None:
                    stats[counter] += 1
                    if not dry_run:
                        txn.delete(key, db=self._db[db])

                current = {_split(k)[0]: json.loads(v) for k, v in self._scan(txn, "current")}
                live_docs, live_versions = set(), set()
                for k, v in list(self._scan(txn, "docs")):
                    doc_id, dv = _split(k)
                    if current.get(doc_id) == dv:
                        live_docs.add((doc_id, dv))
                        refs.add(_doc_from(v).text_object)
                    else:
                        drop("docs", k, "doc_versions_removed")
                for k, v in list(self._scan(txn, "versions")):
                    key = tuple(_split(k))
                    if key[:2] in live_docs:
                        live_versions.add(key)
                        refs.update(c.object for c in _version_from(v).chunks)
                    else:
                        drop("versions", k, "versions_removed")
                for k, _ in list(self._scan(txn, "prefix")):
                    _, label, _, doc_id, dv = _split(k)
                    if (doc_id, dv, label) not in live_versions:  # superseded or dangling
                        drop("prefix", k, "prefix_entries_removed")

            def reclaim(p: Path, counter: str) -> None:
                stats[counter] += 1
                stats["bytes_freed"] += p.stat().st_size
                if not dry_run:
                    p.unlink()

            # Files go only after the catalog txn committed: a crash in between leaves
            # unreferenced files (harmless), never a reference to a deleted file.
            for p in self._object_files():
                if _SHA_RE.match(p.name) and p.name not in refs:
                    reclaim(p, "objects_removed")
            now = time.time()
            for p in sorted(self.tmp_dir.iterdir()) if self.tmp_dir.is_dir() else []:
                if p.is_file() and now - p.stat().st_mtime >= tmp_grace_s:
                    reclaim(p, "tmp_removed")
            return stats

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
                    entries["/".join(_split(k))] = val
                out[db] = dict(sorted(entries.items()))
        return out
