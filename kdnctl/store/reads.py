"""Catalog reads: every record is decoded, checksum-checked and validated here (records.py).

A mixin of Store: it needs ``root``, ``_env`` (the LMDB environment) and ``_db`` (handles)."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, Callable, Iterator

import lmdb

from kdnctl.errors import KdnError, NotFoundError, StoreCorruptError, UsageError

from . import catalog as cat
from .catalog import DBS
from .records import CATALOG_HINT, SEP, ChunkRef, DocumentRecord, VersionRecord, record_dict


def dumps_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode("utf-8")


def _show(k: bytes) -> str:
    return repr(k.replace(b"\x00", b"/"))[2:-1][:80]


SUM_KEY = "_sum"  # per-record checksum: a flipped byte inside a record cannot read as another valid value


def seal_record(record) -> bytes:
    d = record_dict(record)
    d[SUM_KEY] = hashlib.sha256(dumps_json(d)).hexdigest()[:16]
    return dumps_json(d)


def _unseal(raw: bytes, what: str) -> dict:
    d = json.loads(raw)
    if isinstance(d, dict) and SUM_KEY in d:  # records written before checksums have none
        want = d.pop(SUM_KEY)
        if hashlib.sha256(dumps_json(d)).hexdigest()[:16] != want:
            raise StoreCorruptError(f"{what} fails its checksum (damaged bytes)", hint=CATALOG_HINT)
    return d


def lookup_key(*parts: str) -> bytes | None:
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


def check_lookup(kind: str, value) -> None:
    """An id no record can have because of its form (empty, not text, NUL, a lone surrogate) is a
    usage error, not damage; one that is merely too long is simply not in the store."""
    from .records import id_problem

    problem = id_problem(kind, value)
    if problem and not problem.startswith(f"{kind} "):  # (the length problem reads "<kind> '...' is longer")
        raise UsageError(problem, param=kind)


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


class CatalogReader:
    root: Any
    _env: Any
    _db: dict

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
        k = lookup_key(doc_id)
        raw = txn.get(k, db=self._db["current"]) if k is not None else None
        if raw is None:
            return None
        dv = json.loads(raw)
        if not isinstance(dv, str) or not dv:
            raise StoreCorruptError(f"current-version entry of {doc_id!r} is {str(dv)[:40]!r}", hint=CATALOG_HINT)
        return dv

    def _scan(self, txn, db: str, *prefix: str) -> Iterator[tuple[bytes, bytes]]:
        if prefix:
            p = lookup_key(*prefix)
            if p is None or not all(prefix):
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
        check_lookup("doc_id", doc_id)
        if doc_version is not None:
            check_lookup("doc_version", doc_version)
        with self._env.begin() as txn:
            dv = doc_version or self._current(txn, doc_id)
            k = lookup_key(doc_id, dv) if dv else None
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
        check_lookup("doc_id", doc_id)
        with self._env.begin() as txn:
            docs = [self._doc(k, v) for k, v in self._scan(txn, "docs", doc_id)]
        return sorted(docs, key=lambda d: (d.created, d.doc_version))

    @catalog_reads
    def get_version(self, doc_id: str, label: str = "full", doc_version: str | None = None) -> VersionRecord:
        check_lookup("doc_id", doc_id)
        check_lookup("label", label)
        if doc_version is not None:
            check_lookup("doc_version", doc_version)
        with self._env.begin() as txn:
            dv = doc_version or self._current(txn, doc_id)
            dk = lookup_key(doc_id, dv) if dv else None
            if dk is None or txn.get(dk, db=self._db["docs"]) is None:
                raise NotFoundError(f"document {doc_id!r}" + (f" version {doc_version}" if doc_version else "")
                                    + " is not in the store")
            vk = lookup_key(doc_id, dv, label)
            raw = txn.get(vk, db=self._db["versions"]) if vk is not None else None
            if raw is None:
                labels = [cat.split(k)[2] for k, _ in self._scan(txn, "versions", doc_id, dv)]
                raise NotFoundError(
                    f"document {doc_id!r} has no version labelled {label!r}",
                    hint=f"labels stored for {doc_id}: {', '.join(labels) or '(none)'}",
                )
            return self._version(vk, raw)

    def _checked_versions(self, txn, *prefix: str) -> list[VersionRecord]:
        """Every version record under ``prefix`` (a doc id, or nothing for all), each key
        checked against its record and the keys' order checked. A flipped byte in a key moves
        its record out of reach of a (doc, doc_version) lookup; reading the wider range turns
        that into damage reported, never a version silently missing from a listing."""
        out, prev = [], None
        for k, v in self._scan(txn, "versions", *prefix):
            if prev is not None and k <= prev:
                raise StoreCorruptError("catalog version keys are out of order (damaged index)", hint=CATALOG_HINT)
            prev = k
            out.append(self._version(k, v))
        return out

    @catalog_reads
    def list_versions(self, doc_id: str | None = None) -> list[VersionRecord]:
        """Labels of the current document versions (of one document, or of all)."""
        with self._env.begin() as txn:
            ids = [doc_id] if doc_id is not None else [cat.split(k)[0] for k, _ in self._scan(txn, "current")]
            current = {d: self._current(txn, d) for d in ids}
            records = self._checked_versions(txn, doc_id) if doc_id is not None else self._checked_versions(txn)
        return [v for v in records if current.get(v.doc_id) == v.doc_version]

    @catalog_reads
    def _all_documents(self) -> list[DocumentRecord]:
        """Every document record, superseded ones included."""
        with self._env.begin() as txn:
            return [self._doc(k, v) for k, v in self._scan(txn, "docs")]

    @catalog_reads
    def all_versions(self) -> list[VersionRecord]:
        """Every version record, superseded ones (still in gc's grace period) included."""
        with self._env.begin() as txn:
            return self._checked_versions(txn)

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
            for k, v in self._prefix_keys(txn, fingerprint, label, chain_hash, visible):
                doc_id, dv = cat.split(k)[3:5]
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

    def _prefix_keys(self, txn, fingerprint: str, label: str, chain_hash: str,
                     visible: Callable[[str], bool] | None) -> list[tuple[bytes, bytes]]:
        """Prefix entries of this chain hash whose doc id is visible, found with the same steps
        whether the hash is stored invisibly or not at all: every examined key (the terminating
        non-match included) costs one split, one ``visible`` call and one cursor step, and the
        probe always examines at least two keys."""
        p = lookup_key(fingerprint, label, chain_hash)
        if p is None:
            return []
        p += SEP.encode()
        cur = txn.cursor(db=self._db["prefix"])
        ok = cur.set_range(p)
        found, examined = [], 0
        while True:
            k, v = (cur.key(), cur.value()) if ok else (b"", b"")
            match = ok and k.startswith(p)
            parts = k.split(b"\x00")
            doc_id = parts[3].decode("utf-8", "replace") if len(parts) == 5 else ""
            allowed = visible(doc_id) if visible is not None else True
            examined += 1
            ok = cur.next() if ok else False
            if not match:
                break
            if allowed:
                found.append((k, v))
        while examined < 2:  # pad an absent probe to the steps of a single invisible hit
            doc_id = b"".split(b"\x00")[0].decode()
            if visible is not None:
                visible(doc_id)
            ok = cur.next() if ok else False
            examined += 1
        return found

    def chunk_sizes(self) -> list[int]:
        """Distinct chunk lengths of current versions, for prefix lookups that must re-hash a
        prompt with each chunking the store holds."""
        return chunk_sizes_of(self.list_versions())

    @catalog_reads
    def catalog_dump(self) -> dict:
        """Every catalog entry, keys joined with '/', `created` removed: equal for equal stores."""
        out: dict[str, dict] = {}
        with self._env.begin() as txn:
            for db in DBS:
                entries = {}
                for k, v in self._scan(txn, db):
                    if db == "meta" and k == cat.STORE_ID_KEY:
                        continue  # each store's own
                    val = json.loads(v)
                    if isinstance(val, dict):
                        val.pop("created", None)
                        val.pop(SUM_KEY, None)
                    entries["/".join(cat.split(k))] = val
                out[db] = dict(sorted(entries.items()))
        return out



def chunk_sizes_of(versions) -> list[int]:
    """Distinct chunk lengths (recipe chunk_tokens, else the first chunk's length)."""
    sizes = set()
    for v in versions:
        n = v.recipe.get("chunk_tokens") if isinstance(v.recipe, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            sizes.add(n)
        elif v.chunks:
            sizes.add(v.chunks[0].token_end - v.chunks[0].token_start)
    return sorted(sizes)
