"""The LMDB catalog file: checked before it is mapped, created atomically, shared per process.

LMDB maps data.mdb and trusts it: a truncated file makes the first read past its end a SIGBUS,
which kills the process with no message. ``check_data_file`` reads LMDB's two meta pages
(magic, version, page size, last page number) and refuses a file that ends before a page LMDB
may read. A file may legitimately end early: a page allocated and freed in the same txn (LMDB's
"loose" pages) counts in the last page number but is never written, only listed as free. So a
file shorter than the last page number is complete exactly when every missing page is listed
in the free-page DB of the meta LMDB opens (the newer one): LMDB never reads a free page, it
writes a fresh one when it reuses the number. (LMDB itself refuses page numbers beyond the meta's
last page, so flipped page pointers cannot reach past that either.)
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from pathlib import Path

import lmdb

from kdnctl.errors import StoreCorruptError, UnsupportedError

from .durable import fsync_dir
from .lmdb_file import META_LAST_PG, LmdbFileError, free_pages, read_meta
from .records import CATALOG_HINT, SEP

SCHEMA_VERSION = 1
MAP_SIZE = 1 << 30  # virtual reservation only: data.mdb grows with use (sparse on Linux)
DBS = ("meta", "docs", "current", "versions", "prefix")


def damaged_error(root: Path, what: str) -> StoreCorruptError:
    return StoreCorruptError(f"store {root} is damaged: {what}; nothing was changed", hint=CATALOG_HINT)


def check_data_file(root: Path, path: Path) -> None:
    """Raise StoreCorruptError unless ``path`` is a complete LMDB data file (see module doc)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            first = read_meta(f.read(META_LAST_PG + 16))
            if first is not None:
                f.seek(first["psize"])
                second = read_meta(f.read(META_LAST_PG + 16))
            else:
                second = None
            if size == 0:
                raise damaged_error(root, f"catalog {path} is empty (0 bytes)")
            if first is None or second is None:
                raise damaged_error(root, f"catalog {path} is not an LMDB file (bad meta page; {size} bytes)")
            if first["psize"] != second["psize"]:
                raise damaged_error(root, f"catalog {path} has inconsistent meta pages")
            newer = max(first, second, key=lambda m: m["txnid"])  # the one mdb_env_open picks
            psize, need = newer["psize"], newer["last_pg"] + 1
            if size < need * psize:
                missing = set(range(size // psize, need))
                try:
                    unlisted = missing - free_pages(f, psize, newer["free_root"], newer["last_pg"])
                except LmdbFileError as e:
                    unlisted, why = missing, f": {e}"
                else:
                    why = ""
                if unlisted:
                    raise damaged_error(root, f"catalog {path} is truncated ({size} bytes, it uses "
                                              f"{need * psize}; page {min(unlisted)} is missing{why})")
    except OSError as e:
        raise damaged_error(root, f"catalog {path} cannot be read ({e.strerror or e})") from None


# LMDB forbids opening one environment twice in a process, so Store instances on the same
# root share one Environment (refcounted). The write lock stays per instance (own fd).
_ENVS: dict[str, list] = {}
_ENVS_LOCK = threading.Lock()


def acquire_env(root: Path, catalog_dir: Path) -> tuple[str, lmdb.Environment]:
    key = str(catalog_dir.resolve())
    with _ENVS_LOCK:
        if key not in _ENVS:
            check_data_file(root, catalog_dir / "data.mdb")
            writable = os.access(catalog_dir / "data.mdb", os.W_OK)
            try:
                env = lmdb.open(key, subdir=True, map_size=MAP_SIZE, max_dbs=8, lock=True, create=False,
                                readonly=not writable)
            except lmdb.Error as e:
                raise damaged_error(root, f"catalog {catalog_dir} cannot be opened ({e})") from None
            _ENVS[key] = [env, 0]
        _ENVS[key][1] += 1
        return key, _ENVS[key][0]


def release_env(key: str) -> None:
    with _ENVS_LOCK:
        entry = _ENVS.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                entry[0].close()
                del _ENVS[key]


def forget_env(catalog_dir: Path) -> None:
    """Close and drop this process's shared environment of ``catalog_dir`` (its store is being
    removed): a later store at the same path must not get the old mapping."""
    with _ENVS_LOCK:
        entry = _ENVS.pop(str(Path(catalog_dir).resolve()), None)
    if entry is not None:
        entry[0].close()


def open_dbs(root: Path, env: lmdb.Environment) -> dict:
    """Handles of the catalog's databases (opened, never created), after
    checking the schema key. A catalog without it is damaged, not new: only create_catalog
    makes catalogs, and it writes the key in the same txn as the databases."""
    try:
        # No txn given: py-lmdb uses a short txn that only opens existing databases; with
        # create=False it dirties nothing, so LMDB writes nothing (tests check the file bytes).
        dbs = {name: env.open_db(name.encode(), create=False) for name in DBS}
        with env.begin() as txn:
            raw = txn.get(b"schema_version", db=dbs["meta"])
    except lmdb.NotFoundError:
        raise damaged_error(root, "the catalog lacks one of its databases") from None
    except lmdb.Error as e:
        raise damaged_error(root, f"the catalog cannot be read ({type(e).__name__}: {e})") from None
    if raw is None:
        raise damaged_error(root, "the catalog has no schema version (emptied or not a kdnctl catalog)")
    try:
        schema = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        schema = raw
    if not isinstance(schema, int) or isinstance(schema, bool):
        raise damaged_error(root, f"the catalog's schema version {str(schema)[:40]!r} is not an integer")
    if schema != SCHEMA_VERSION:
        raise UnsupportedError(f"store {root} has catalog schema {schema}; this kdnctl reads schema {SCHEMA_VERSION}",
                               hint="use the kdnctl version that wrote this store")
    return dbs



# Catalog meta keys besides the schema version: the store's identity (the same id is written
# beside the objects, IDENTITY_FILE), the time and count of the last record commit, and gc's
# bookkeeping (``retired``/``released``/``held`` entries, keyed by a prefix).
STORE_ID_KEY = b"store_id"
LAST_COMMIT_KEY = b"last_commit"
IDENTITY_FILE = "store-id"  # in objects/: which store these objects belong to


def new_store_id() -> str:
    return uuid.uuid4().hex


def read_identity_file(objects_dir: Path) -> str | None:
    """The store id written beside the objects, or None if there is none (a store made before
    identities existed). A file that does not hold an id is damage, not absence."""
    path = Path(objects_dir) / IDENTITY_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StoreCorruptError(f"{path} cannot be read ({e.strerror or e})", hint=CATALOG_HINT) from None
    try:
        sid = json.loads(raw)["store_id"]
    except (ValueError, UnicodeDecodeError, TypeError, KeyError):
        sid = None
    if not (isinstance(sid, str) and len(sid) == 32 and all(ch in "0123456789abcdef" for ch in sid)):
        raise StoreCorruptError(f"{path} does not hold a store id (damaged)", hint=CATALOG_HINT)
    return sid


def write_identity_file(objects_dir: Path, store_id: str) -> None:
    from .durable import write_atomic

    write_atomic(Path(objects_dir) / IDENTITY_FILE, [json.dumps({"store_id": store_id}).encode()])


def create_catalog(catalog_dir: Path, store_id: str | None = None) -> None:
    """Make a new catalog beside ``catalog_dir`` (databases + schema key + the store id, one txn),
    then rename it into place: a crash leaves either no catalog or a complete one, never an empty one."""
    staging = catalog_dir.parent / f".catalog-new-{uuid.uuid4().hex[:12]}"
    staging.mkdir(parents=True)
    try:
        env = lmdb.open(str(staging), subdir=True, map_size=MAP_SIZE, max_dbs=8, lock=True)
        try:
            with env.begin(write=True) as txn:
                dbs = {name: env.open_db(name.encode(), txn=txn) for name in DBS}
                txn.put(b"schema_version", json.dumps(SCHEMA_VERSION).encode(), db=dbs["meta"])
                if store_id is not None:
                    txn.put(STORE_ID_KEY, json.dumps(store_id).encode(), db=dbs["meta"])
            env.sync(True)
        finally:
            env.close()
        (staging / "lock.mdb").unlink(missing_ok=True)
        fsync_dir(staging)
        try:
            os.rename(staging, catalog_dir)  # replaces an empty leftover dir; fails if one is complete
        except OSError:
            if not (catalog_dir / "data.mdb").exists():
                raise
        fsync_dir(catalog_dir.parent)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def key(*parts: str) -> bytes:
    return SEP.join(parts).encode("utf-8")


def split(raw: bytes) -> list[str]:
    return raw.decode("utf-8").split(SEP)
