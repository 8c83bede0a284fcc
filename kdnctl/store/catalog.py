"""The LMDB catalog file: checked before it is mapped, created atomically, shared per process.

LMDB maps data.mdb and trusts it: a truncated file makes the first read past its end a SIGBUS,
which kills the process with no message. ``check_data_file`` reads LMDB's two meta pages
(magic, version, page size, last page number) and refuses a file shorter than the pages the
catalog says it uses, so every page LMDB may touch exists. (LMDB itself refuses page numbers
beyond the meta's last page, so flipped page pointers cannot reach past the file either.)
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import uuid
from pathlib import Path

import lmdb

from kdnctl.errors import StoreCorruptError, UnsupportedError

from ..durable import fsync_dir
from .records import CATALOG_HINT, SEP

SCHEMA_VERSION = 1
MAP_SIZE = 1 << 30  # virtual reservation only: data.mdb grows with use (sparse on Linux)
DBS = ("meta", "docs", "current", "versions", "prefix")

_LMDB_MAGIC = 0xBEEFC0DE
_LMDB_DATA_VERSION = 1
_P_META = 0x08
_PAGE_HEADER = 16  # pgno (8), pad (2), flags (2), lower (2), upper (2)
_META_LAST_PG = _PAGE_HEADER + 8 + 8 + 8 + 2 * 48  # magic+version, address, mapsize, 2 x MDB_db


def damaged_error(root: Path, what: str) -> StoreCorruptError:
    return StoreCorruptError(f"store {root} is damaged: {what}; nothing was changed", hint=CATALOG_HINT)


def _read_meta(data: bytes, offset: int) -> tuple[int, int, int] | None:
    """(page size, last page, txnid) of the LMDB meta page at ``offset``, or None if it is not one."""
    if len(data) < offset + _META_LAST_PG + 16:
        return None
    _pgno, _pad, flags = struct.unpack_from("<QHH", data, offset)
    magic, version = struct.unpack_from("<II", data, offset + _PAGE_HEADER)
    psize = struct.unpack_from("<I", data, offset + _PAGE_HEADER + 24)[0]  # free DB's md_pad
    last_pg, txnid = struct.unpack_from("<QQ", data, offset + _META_LAST_PG)
    if not flags & _P_META or magic != _LMDB_MAGIC or version != _LMDB_DATA_VERSION:
        return None
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        return None
    return psize, last_pg, txnid


def check_data_file(root: Path, path: Path) -> None:
    """Raise StoreCorruptError unless ``path`` is a complete LMDB data file (see module doc)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(_META_LAST_PG + 16)
            first = _read_meta(head, 0)
            if first is not None:
                f.seek(first[0])
                second = _read_meta(f.read(_META_LAST_PG + 16), 0)
            else:
                second = None
    except OSError as e:
        raise damaged_error(root, f"catalog {path} cannot be read ({e.strerror or e})") from None
    if size == 0:
        raise damaged_error(root, f"catalog {path} is empty (0 bytes)")
    if first is None or second is None:
        raise damaged_error(root, f"catalog {path} is not an LMDB file (bad meta page; {size} bytes)")
    if first[0] != second[0]:
        raise damaged_error(root, f"catalog {path} has inconsistent meta pages")
    psize = first[0]
    need = max(first[1], second[1]) + 1
    if size < need * psize:
        raise damaged_error(root, f"catalog {path} is truncated ({size} bytes, its meta pages need {need * psize})")


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



def create_catalog(catalog_dir: Path) -> None:
    """Make a new catalog beside ``catalog_dir`` (databases + schema key, one txn), then rename
    it into place: a crash leaves either no catalog or a complete one, never an empty one."""
    staging = catalog_dir.parent / f".catalog-new-{uuid.uuid4().hex[:12]}"
    staging.mkdir(parents=True)
    try:
        env = lmdb.open(str(staging), subdir=True, map_size=MAP_SIZE, max_dbs=8, lock=True)
        try:
            with env.begin(write=True) as txn:
                dbs = {name: env.open_db(name.encode(), txn=txn) for name in DBS}
                txn.put(b"schema_version", json.dumps(SCHEMA_VERSION).encode(), db=dbs["meta"])
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
