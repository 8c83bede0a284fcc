"""Key-basis records: which stored object is a model's key basis (kdnctl/quant/store_basis.py).

A basis calibrated for a model that ships none is an ordinary content-addressed object
(``objects/ab/<sha256>``, written temp + fsync + rename by ``put_object``) and one sealed entry
in the catalog's ``meta`` database, ``basis/<model fingerprint>`` -> ``{"object", "created",
"source"}``, committed in one txn after the object is durable. ``gc`` counts these objects as
referenced; ``verify`` checks the record, the object's bytes and that it is a basis file;
``rebuild-catalog`` recovers the record from the file, which names its model.

The store layer only keeps bytes and records; what a basis is (decode, orthonormal axes)
lives in kdnctl/quant/basis.py.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

from kdnctl.errors import StoreCorruptError

from . import catalog as cat
from .reads import SUM_KEY, _unseal, dumps_json
from .records import CATALOG_HINT, is_sha

KIND = "basis"  # meta key prefix


@dataclass(frozen=True)
class BasisRecord:
    fingerprint: str
    object: str  # sha256 of the basis file
    created: float
    source: str  # how it was made (one line)


def _seal(d: dict) -> bytes:
    d = dict(d)
    d[SUM_KEY] = hashlib.sha256(dumps_json(d)).hexdigest()[:16]
    return dumps_json(d)


def unseal_model_record(raw: bytes, what: str) -> dict:
    """The fields of a model's basis or profile record, which is always sealed (ValueError where
    it is not; StoreCorruptError where its checksum fails)."""
    if b'"' + SUM_KEY.encode() + b'"' not in raw:
        raise ValueError(f"{what} is not sealed")
    return _unseal(raw, what)


def parse(key_parts: list[str], raw: bytes) -> BasisRecord:
    """A basis record from its meta entry; damage -> StoreCorruptError."""
    what = f"key basis record {'/'.join(key_parts)[:80]}"
    try:
        d = unseal_model_record(raw, what)
    except (ValueError, UnicodeDecodeError):
        raise StoreCorruptError(f"{what} is unreadable", hint=CATALOG_HINT) from None
    if not isinstance(d, dict):
        raise StoreCorruptError(f"{what} is not a record", hint=CATALOG_HINT)
    obj, created, source = d.get("object"), d.get("created"), d.get("source", "")
    if (len(key_parts) != 2 or not key_parts[1] or not isinstance(obj, str) or not is_sha(obj)
            or not isinstance(created, (int, float)) or isinstance(created, bool) or not isinstance(source, str)):
        raise StoreCorruptError(f"{what} is damaged", hint=CATALOG_HINT)
    return BasisRecord(key_parts[1], obj, float(created), source)


def basis_record(store, fingerprint: str) -> BasisRecord | None:
    """The store's key basis record for ``fingerprint``, or None."""
    k = cat.key(KIND, fingerprint)
    with store._env.begin() as txn:
        raw = txn.get(k, db=store._db["meta"])
    return None if raw is None else parse([KIND, fingerprint], raw)


def basis_records(store, txn=None) -> list[BasisRecord]:
    """Every key basis record of the store (damage raises)."""
    def scan(t):
        out = []
        for k, v in store._scan(t, "meta"):
            parts = cat.split(k)
            if parts[0] == KIND:
                out.append(parse(parts, v))
        return out

    if txn is not None:
        return scan(txn)
    with store._env.begin() as t:
        return scan(t)


def commit_basis(store, fingerprint: str, data: bytes, source: str) -> str:
    """Store a basis file (durable object first) and record it for ``fingerprint`` in one txn;
    returns its sha256. Needs the writer lock."""
    store._require_writer("commit_basis")
    sha = store.put_object(data)
    now = time.time()
    with store._env.begin(write=True) as txn:
        txn.put(cat.key(KIND, fingerprint), _seal({"object": sha, "created": now, "source": source[:200]}),
                db=store._db["meta"])
        store._stamp_commit(txn, now)
    return sha


def file_fingerprint(data: bytes) -> tuple[bool, str | None]:
    """(whether ``data`` is a key basis file, the model fingerprint it names or None), from its
    safetensors header alone (what the axes hold is kdnctl/quant/basis.py's check)."""
    try:
        n = int.from_bytes(bytes(data[:8]), "little")
        if not 2 <= n <= len(data) - 8:
            return False, None
        meta = json.loads(bytes(data[8:8 + n])).get("__metadata__") or {}
    except (ValueError, UnicodeDecodeError, AttributeError):
        return False, None
    if not isinstance(meta, dict) or meta.get("kdnctl") != "key_basis":
        return False, None
    fp = meta.get("fingerprint")
    return True, fp if isinstance(fp, str) else None


def pull_bases(remote, store, chunk_objects: list[str]) -> int:
    """Copy into ``store`` the key bases that the (already stored) bundles ``chunk_objects`` are
    coded in, where ``remote`` holds them and ``store`` does not (a shipped basis is in neither),
    each with its model's record where the store has none. Returns how many objects were copied."""
    from .protocol import read_bundle_meta

    shas = []
    for obj in dict.fromkeys(chunk_objects):
        q = read_bundle_meta(store, obj).get("quant")
        sha = q.get("key_basis") if isinstance(q, dict) else None
        if isinstance(sha, str) and is_sha(sha) and sha not in shas:
            shas.append(sha)
    n = 0
    for sha in shas:
        if store.has_object(sha) or not remote.has_object(sha):
            continue
        data = bytes(remote.read_object(sha))  # verified against its sha256
        is_basis, fp = file_fingerprint(data)
        if not is_basis:
            raise StoreCorruptError(f"object {sha[:12]}, named as a key basis by a pulled bundle, is not one")
        if fp is not None and basis_record(store, fp) is None:
            commit_basis(store, fp, data, "pulled from a remote store")
        elif store.put_object(data) != sha:
            raise StoreCorruptError(f"object {sha[:12]} changed while being stored")
        n += 1
    return n
