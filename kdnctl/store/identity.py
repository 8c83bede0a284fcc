"""The store's identity and last-commit time (docs/store.md, "Safety"), a mixin of Store.

A store gets an id at creation, written beside the objects (``objects/store-id``) and into the
catalog; gc trusts a catalog only when the two agree. The catalog also records when a record
was last committed: gc keeps unreferenced objects newer than that.
"""

from __future__ import annotations

import json
from typing import Any

from kdnctl.errors import StoreCorruptError

from . import catalog as cat
from .reads import dumps_json
from .records import CATALOG_HINT


class Identity:
    root: Any
    objects_dir: Any
    _env: Any
    _db: dict

    def _meta_json(self, key: bytes, txn=None) -> tuple[bytes | None, object]:
        """(the raw value of catalog meta key ``key``, its JSON or None where it does not parse),
        read in ``txn`` or a read transaction of its own."""
        if txn is None:
            with self._env.begin() as t:
                raw = t.get(key, db=self._db["meta"])
        else:
            raw = txn.get(key, db=self._db["meta"])
        try:
            return raw, None if raw is None else json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return raw, None

    def catalog_identity(self, txn=None) -> str | None:
        """The store id recorded in the catalog, or None (a catalog made before identities)."""
        raw, sid = self._meta_json(cat.STORE_ID_KEY, txn)
        if raw is None:
            return None
        if not isinstance(sid, str) or len(sid) != 32:
            raise StoreCorruptError(f"the catalog of {self.root} holds a damaged store id", hint=CATALOG_HINT)
        return sid

    def objects_identity(self) -> str | None:
        """The store id written beside the objects, or None."""
        return cat.read_identity_file(self.objects_dir)

    def _ensure_identity(self) -> None:
        """A writer's first step: a store made before identities existed adopts one (written
        beside the objects, then into the catalog); a catalog without an id in a store that has
        one adopts it only when every record it holds points at an object that is here (it is
        this store's catalog from before the identity, not another store's). Anything else is
        left for ``check_identity`` to refuse where it matters (gc)."""
        in_catalog, beside = self.catalog_identity(), self.objects_identity()
        if in_catalog is not None:
            if beside is None and not self._has_objects():
                cat.write_identity_file(self.objects_dir, in_catalog)  # a create cut short
            return
        if beside is None:
            beside = cat.new_store_id()
            cat.write_identity_file(self.objects_dir, beside)
        elif self._records_point_elsewhere():
            return
        with self._env.begin(write=True) as txn:
            txn.put(cat.STORE_ID_KEY, json.dumps(beside).encode(), db=self._db["meta"])

    def _has_objects(self) -> bool:
        return self.objects_dir.is_dir() and any(p.is_file() for sub in self.objects_dir.iterdir() if sub.is_dir()
                                                 for p in sub.iterdir())

    def _records_point_elsewhere(self) -> bool:
        try:
            refs = {d.text_object for d in self._all_documents()}
            refs.update(c.object for v in self.all_versions() for c in v.chunks)
        except StoreCorruptError:
            return True
        return any(not self.has_object(sha) for sha in refs)

    def check_identity(self, what: str) -> str:
        """The store id, after checking the catalog belongs to these objects (refuses otherwise)."""
        in_catalog, beside = self.catalog_identity(), self.objects_identity()
        if in_catalog is not None and in_catalog == beside:
            return in_catalog
        if in_catalog is None:
            why = "the catalog records no store id but the objects have one" if beside else "the store has no id"
        elif beside is None:
            why = f"the objects carry no store id (objects/{cat.IDENTITY_FILE} is missing) but the catalog does"
        else:
            why = (f"the catalog belongs to another store (catalog id {in_catalog[:12]}, "
                   f"objects' id {beside[:12]})")
        raise StoreCorruptError(f"{what} refused: {why}; nothing was deleted",
                                hint="put this store's own catalog back (or rebuild it with `kdnctl rebuild-catalog`), "
                                     "then run `kdnctl verify`")

    def last_commit(self, txn=None) -> float | None:
        """When a record was last committed (None: never, in a catalog made before this was kept)."""
        raw, value = self._meta_json(cat.LAST_COMMIT_KEY, txn)
        if raw is None:
            return None
        try:
            t = value["created"]
        except (TypeError, KeyError):
            t = None
        if not isinstance(t, (int, float)) or isinstance(t, bool):
            raise StoreCorruptError(f"the catalog of {self.root} holds a damaged last-commit entry", hint=CATALOG_HINT)
        return float(t)

    def _stamp_commit(self, txn, now: float) -> None:
        prev = self.last_commit(txn)
        txn.put(cat.LAST_COMMIT_KEY, dumps_json({"created": max(now, prev or 0.0)}), db=self._db["meta"])

