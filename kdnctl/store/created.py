"""Stores a command created: one that fails before writing anything leaves no new store behind
(the CLI's error mapping calls ``discard_unused_new_stores``)."""

from __future__ import annotations

import shutil
from pathlib import Path

from . import catalog as cat

LAYOUT = {"objects", "tmp", "catalog", "write.lock"}

# Stores this process created (root, whether the directory existed before): a command that
# fails before it wrote anything removes the empty store it made (``discard_unused_new_stores``).
_CREATED: list[tuple[Path, bool]] = []


def remember_created(root: Path, existed: bool) -> None:
    _CREATED.append((root, existed))


def forget_new_stores() -> None:
    _CREATED.clear()


def discard_unused_new_stores() -> list[Path]:
    """Remove every store this process created that still holds no record and no object (the
    command that made it failed before writing). Returns the roots removed."""
    removed = []
    while _CREATED:
        root, existed = _CREATED.pop()
        objects = root / "objects"
        if any(p.is_file() for p in objects.rglob("*") if p.name != cat.IDENTITY_FILE) if objects.is_dir() else False:
            continue
        try:
            empty = catalog_is_empty(root / "catalog")
        except Exception:  # noqa: BLE001 - not a catalog this process can read: leave it alone
            empty = False
        if not empty:
            continue
        cat.forget_env(root / "catalog")
        for name in LAYOUT:
            path = root / name
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists():
                path.unlink(missing_ok=True)
        if not existed:
            try:
                root.rmdir()
            except OSError:
                pass
        removed.append(root)
    return removed


def catalog_is_empty(catalog_dir: Path) -> bool:
    """True if the catalog holds no document, version, current or prefix entry."""
    import lmdb

    key = str(catalog_dir.resolve())
    shared = cat._ENVS.get(key)
    env = shared[0] if shared else lmdb.open(key, subdir=True, max_dbs=8, readonly=True, lock=False, create=False)
    try:
        with env.begin() as txn:
            return all(txn.stat(env.open_db(name.encode(), txn=txn, create=False))["entries"] == 0
                       for name in ("docs", "versions", "current", "prefix"))
    finally:
        if not shared:
            env.close()


