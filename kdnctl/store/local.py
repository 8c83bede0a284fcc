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
import errno
import fcntl
import hashlib
import os
import socket
import uuid
from pathlib import Path
from typing import Iterator

from kdnctl.errors import NotFoundError, StoreCorruptError, StoreLockedError, StoreReadOnlyError, UsageError

from .durable import fsync_dir
from . import catalog as cat
from .created import LAYOUT, remember_created
from .identity import Identity
from .maintenance import Maintenance, hash_file
from .reads import CatalogReader, dumps_json, lookup_key, seal_record
from .records import DocumentRecord, VersionRecord, check_id, check_sha, record_dict

READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


def read_only_error(root: Path) -> StoreReadOnlyError:
    return StoreReadOnlyError(f"store {root} is read-only")


def default_store_root() -> Path:
    return Path(os.environ.get("KDN_STORE", ".kdn"))


class Store(CatalogReader, Maintenance, Identity):
    def __init__(self, root: str | os.PathLike, *, create: bool = True):
        self.root = Path(root)
        self.objects_dir = self.root / "objects"
        self.tmp_dir = self.root / "tmp"
        self.catalog_dir = self.root / "catalog"
        self.lock_path = self.root / "write.lock"
        self._lock_fd: int | None = None
        self._lock_depth = 0
        self._blake3_of: dict[str, str] = {}  # sha256 -> BLAKE3 of objects written by this process
        self._xxh3_of: dict[str, str] = {}  # sha256 -> XXH3-128 of the same (local reads check it)
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
        has_objects = self.objects_dir.is_dir() and any(p.is_file() and p.name != cat.IDENTITY_FILE
                                                        for p in self.objects_dir.rglob("*"))
        if has_objects:
            raise cat.damaged_error(self.root, "it holds objects but no catalog (catalog/data.mdb is missing)")
        if entries - LAYOUT - leftovers:
            if create:
                raise UsageError(f"{self.root} is not empty and is not a kdnctl store; refusing to create one there",
                                 hint="pass --store with a new or empty directory")
            raise NotFoundError(f"no kdnctl store at {self.root}",
                                hint="point KDN_STORE/--store at an existing store")
        if not create:
            raise NotFoundError(f"no kdnctl store at {self.root}",
                                hint="run `kdnctl ingest` first, or point KDN_STORE/--store at an existing store")
        existed = self.root.is_dir()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if self.catalog_dir.is_dir() and set(os.listdir(self.catalog_dir)) <= {"lock.mdb"}:
                (self.catalog_dir / "lock.mdb").unlink(missing_ok=True)  # an old-style create cut short
            for d in (self.objects_dir, self.tmp_dir):
                d.mkdir(exist_ok=True)
            # the identity goes beside the objects first, then into the catalog's creating txn:
            # a crash in between leaves an identity file and no catalog, which a retry reuses
            store_id = cat.read_identity_file(self.objects_dir) or cat.new_store_id()
            cat.write_identity_file(self.objects_dir, store_id)
            cat.create_catalog(self.catalog_dir, store_id)
        except OSError as e:
            if e.errno == errno.EROFS:
                raise read_only_error(self.root) from None
            raise UsageError(f"cannot create a store at {self.root}: {e.strerror or e}") from None
        remember_created(self.root, existed)

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
            if self._env.flags().get("readonly"):  # the catalog file itself cannot be written
                raise read_only_error(self.root)
            fd = open_lock(self.root, self.lock_path)
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
            try:
                self._ensure_identity()
            except BaseException:
                self._lock_fd = None
                os.close(fd)
                raise
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
        self._remember_blake3(sha, data)
        final = self.object_path(sha)
        # Idempotent; but a damaged copy of the same content is replaced, not trusted.
        if final.is_file() and hash_file(final) == sha:
            try:  # written again now: gc keeps objects newer than the catalog's last commit
                os.utime(final)
            except OSError:
                pass
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
                fsync_dir(self.objects_dir)  # make the new fan-out dir entry durable
            os.rename(tmp, final)  # atomic: readers see nothing or the whole object
            fsync_dir(final.parent)  # make the rename durable before any commit refers to it
        finally:
            tmp.unlink(missing_ok=True)
        return sha

    def _remember_blake3(self, sha: str, data: bytes) -> None:
        """Record the fast-read digests (BLAKE3, XXH3-128) of an object this process wrote."""
        from .fastread import blake3_hex, xxh3_hex

        digest = blake3_hex(data)
        if digest is not None:
            self._blake3_of[sha] = digest
        digest = xxh3_hex(data)
        if digest is not None:
            self._xxh3_of[sha] = digest

    def read_object_checked(self, sha: str, blake3: str | None = None, xxh3: str | None = None) -> bytearray:
        """The object's bytes in one writable buffer (zero-copy tensor views can point into
        it), every byte checked before return: against ``xxh3`` / ``blake3`` when the catalog
        recorded them, else against the sha256 name (kdnctl/store/fastread.py)."""
        from .fastread import read_verified

        return read_verified(self.object_path(sha), sha, blake3, xxh3)

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
                txn.put(cat.key("released", sha), dumps_json({"created": now}), db=self._db["meta"])
        for c in v.chunks:  # fast-read digests of objects this process wrote (kdnctl/store/fastread.py)
            if c.blake3 is None:
                c.blake3 = self._blake3_of.get(c.object)
            if c.xxh3 is None:
                c.xxh3 = self._xxh3_of.get(c.object)
        txn.put(vkey, seal_record(v), db=self._db["versions"])
        for c in v.chunks:
            pkey = cat.key(v.fingerprint, v.label, c.chain_hash, v.doc_id, v.doc_version)
            txn.put(pkey, dumps_json({"index": c.index}), db=self._db["prefix"])

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
        self.commit_documents([(doc, version)])

    def commit_documents(self, items: list[tuple[DocumentRecord, VersionRecord]]) -> None:
        """Several ``commit_document`` records in ONE txn (all or none), e.g. a driver
        committing a batch of documents whose objects its workers wrote (kdnctl/distributed)."""
        import time

        self._require_writer("commit_document")
        for doc, version in items:
            check_id("doc_id", doc.doc_id)
            check_id("doc_version", doc.doc_version)
            self._check_new(DocumentRecord, doc)
            self._check_version_record(version)
            if (version.doc_id, version.doc_version) != (doc.doc_id, doc.doc_version):
                raise UsageError("commit_document: the version belongs to a different document version")
            self._check_objects([doc.text_object] + [c.object for c in version.chunks], f"document {doc.doc_id}")
        now = time.time()
        with self._env.begin(write=True) as txn:
            for doc, version in items:
                prev = self._current(txn, doc.doc_id)
                if prev is not None and prev != doc.doc_version:  # superseded now: gc's grace starts
                    txn.put(cat.key("retired", doc.doc_id, prev), dumps_json({"created": now}), db=self._db["meta"])
                txn.delete(cat.key("retired", doc.doc_id, doc.doc_version), db=self._db["meta"])
                txn.put(cat.key(doc.doc_id, doc.doc_version), seal_record(doc), db=self._db["docs"])
                txn.put(cat.key(doc.doc_id), dumps_json(doc.doc_version), db=self._db["current"])
                self._put_version(txn, version, now)
            self._stamp_commit(txn, now)

    def commit_version(self, version: VersionRecord) -> None:
        """Add (or replace) a label of an existing document version, in one txn."""
        self.commit_versions([version])

    def commit_versions(self, versions: list[VersionRecord]) -> None:
        """Several ``commit_version`` records in ONE txn (all or none)."""
        import time

        self._require_writer("commit_version")
        for version in versions:
            self._check_version_record(version)
            self._check_objects([c.object for c in version.chunks], f"version {version.doc_id}/{version.label}")
        now = time.time()
        with self._env.begin(write=True) as txn:
            for version in versions:
                if txn.get(cat.key(version.doc_id, version.doc_version), db=self._db["docs"]) is None:
                    raise NotFoundError(f"document {version.doc_id} version {version.doc_version} is not in the store")
                self._put_version(txn, version, now)
            self._stamp_commit(txn, now)

    def remove_document(self, doc_id: str) -> None:
        """Forget a document: it stops being current; `gc` then reclaims its data after the grace period."""
        import time

        self._require_writer("remove_document")
        k = lookup_key(doc_id)
        with self._env.begin(write=True) as txn:
            prev = self._current(txn, doc_id) if k is not None else None
            if prev is None:
                raise NotFoundError(f"document {doc_id!r} is not in the store")
            txn.delete(k, db=self._db["current"])
            txn.put(cat.key("retired", doc_id, prev), dumps_json({"created": time.time()}), db=self._db["meta"])
            self._stamp_commit(txn, time.time())


def open_lock(root: Path, lock_path: Path) -> int:
    """The write lock's file descriptor (not yet locked); a store that cannot be written is one
    clear error, not an OSError."""
    try:
        return os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        if e.errno in READ_ONLY_ERRNOS:
            raise read_only_error(root) from None
        raise


class ObjectDir:
    """The objects/ half of a store without its LMDB catalog: what a worker process on another
    host writes into (a filesystem every worker mounts; kdnctl/distributed). No lock is needed:
    objects are content-addressed and written temp + fsync + rename, so concurrent writers and
    retries are harmless. The same object methods as ``Store``; only the catalog's one writer
    commits references to them."""

    object_path = Store.object_path
    has_object = Store.has_object
    put_object = Store.put_object
    read_object = Store.read_object
    read_object_checked = Store.read_object_checked
    read_object_head = Store.read_object_head
    _remember_blake3 = Store._remember_blake3

    def __init__(self, objects_dir: str | os.PathLike, tmp_dir: str | os.PathLike):
        self.objects_dir, self.tmp_dir = Path(objects_dir), Path(tmp_dir)
        self._blake3_of: dict[str, str] = {}
        self._xxh3_of: dict[str, str] = {}
        if not self.objects_dir.is_dir():
            raise NotFoundError(f"object directory {self.objects_dir} does not exist on this host",
                                hint="every worker must mount the store's objects/ at the same path")

    def stamp_blake3(self, chunks) -> None:
        """Fill the fast-read digests of chunks whose objects this worker wrote (a Store does
        it at commit; the driver that commits a worker's records did not write them)."""
        for c in chunks:
            if getattr(c, "blake3", None) is None:
                c.blake3 = self._blake3_of.get(c.object)
            if getattr(c, "xxh3", None) is None:
                c.xxh3 = self._xxh3_of.get(c.object)
