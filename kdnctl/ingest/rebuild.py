"""Rebuild a damaged catalog from the objects: every prefix-mode bundle names its document,
document version, label, chunk index, token range, chain hash, parent and recipe, so every
version record (full, compressed, edited) can be recomputed exactly. A document's text object
is found by recomputing its document version with ingest's own function (``doc_version_of``:
text hash, model, ingest recipe, prompt header) for every non-bundle object, which needs the
model the bundles were made with (for its prompt header). What cannot be recovered is
reported, never guessed: independent-mode chunks (they are shared and name no document),
documents whose text or model is not available, and incomplete versions; their objects are
held (gc keeps them) until released. A rebuild that would hold fewer versions than the catalog
it replaces needs ``force`` and lists what it drops; the old catalog is always kept beside the
new one (``catalog.damaged-*``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

import contextlib
import fcntl
import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..format.bundle import header_size, read_meta
from ..store.fastread import blake3_hex, xxh3_hex
from ..errors import BundleFormatError, KdnError, StoreLockedError, UsageError
from .prompting import PromptFormat
from ..store import ChunkRef, DocumentRecord, Store, VersionRecord, is_sha
from ..store import catalog as cat
from ..store.local import open_lock
from .prefix import doc_version_of

REBUILT_SOURCE = "(rebuilt from bundles)"


@dataclass
class RebuildReport:
    documents: list[str] = field(default_factory=list)
    versions: int = 0
    skipped: list[str] = field(default_factory=list)  # what could not be recovered, and why
    damaged_catalog: str | None = None
    dropped: list[str] = field(default_factory=list)  # versions the old catalog held that the new one lacks
    held: int = 0  # objects no rebuilt record uses, kept from gc until released
    bases: int = 0  # key basis records recovered from the basis files (each names its model)

    def as_dict(self) -> dict:
        return {"documents": self.documents, "versions": self.versions, "skipped": self.skipped,
                "damaged_catalog": self.damaged_catalog, "dropped": self.dropped, "held": self.held,
                "bases": self.bases}


def _scan(objects: Path, report: RebuildReport) -> tuple[dict, list[str]]:
    groups: dict[tuple, dict[int, tuple[str, dict, int]]] = {}
    others: list[str] = []
    for p in sorted(objects.glob("*/*")):
        if not p.is_file() or not is_sha(p.name):
            continue
        data = p.read_bytes()
        if hashlib.sha256(data).hexdigest() != p.name:
            report.skipped.append(f"object {p.name[:12]} is corrupted; not used")
            continue
        try:
            meta = read_meta(data[: header_size(data[:8])])
        except BundleFormatError:
            others.append(p.name)  # a document text (or foreign bytes)
            continue
        if meta.get("mode", "prefix") != "prefix":
            continue  # independent chunks name no document
        try:
            key = (meta["doc_id"], meta["doc_version"], meta["label"])
            groups.setdefault(key, {})[int(meta["chunk_index"])] = (p.name, meta, len(data), blake3_hex(data), xxh3_hex(data))
        except (KeyError, TypeError, ValueError):
            report.skipped.append(f"bundle {p.name[:12]} lacks its document fields")
    return groups, others


def _ingest_recipe(recipe) -> dict | None:
    if isinstance(recipe, dict) and recipe.get("step") == "ingest":
        return recipe
    steps = recipe.get("steps") if isinstance(recipe, dict) else None
    return steps[0] if isinstance(steps, list) and steps and isinstance(steps[0], dict) else None


def _version(key: tuple, chunks: dict) -> VersionRecord:
    metas = [m for _, m, *_ in chunks.values()]
    first = chunks[min(chunks)][1]
    refs = [ChunkRef(i, sha, m["token_start"], m["token_end"], m["chain_hash"], n, b3, xx)
            for i, (sha, m, n, b3, xx) in sorted(chunks.items())]
    return VersionRecord(key[0], key[1], key[2], first.get("parent"), first["recipe"], first["model_fingerprint"],
                         refs, max(float(m.get("created", 0.0)) for m in metas), max(m["token_end"] for m in metas),
                         "prefix")


@contextlib.contextmanager
def _write_lock(root: Path):
    fd = open_lock(root, root / "write.lock")
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreLockedError(f"store {root} is locked by another writer") from None
        yield
    finally:
        os.close(fd)


def _old_catalog(root: Path) -> tuple[set[str] | None, bool]:
    """The versions (``doc@version/label``) the present catalog holds, or None when it cannot be
    read at all; and whether it is healthy (opens and passes verify's record checks)."""
    try:
        with Store(root, create=False) as st:
            with st._env.begin() as txn:
                keys = {"{}@{}/{}".format(*cat.split(k)) for k, _ in st._scan(txn, "versions")}
            healthy = not st.verify_report(check_bundles=False, rehash=False).problems
            return keys, healthy
    except (KdnError, OSError, ValueError, UnicodeDecodeError, IndexError):
        return None, False
    except Exception:  # noqa: BLE001 - LMDB's own errors on a damaged file: unreadable
        return None, False


def _store_id(objects: Path) -> str:
    try:
        sid = cat.read_identity_file(objects)
    except KdnError:
        sid = None
    if sid is None:
        sid = cat.new_store_id()
        cat.write_identity_file(objects, sid)
    return sid


def rebuild_catalog(root: str | os.PathLike, lm: LoadedModel, *, force: bool = False) -> RebuildReport:
    """Rebuild ``root``'s catalog from its objects with ``lm`` (the model of its bundles)."""
    import json

    root = Path(root)
    if not (root / "objects").is_dir():
        raise UsageError(f"{root} has no objects/ directory: nothing to rebuild from")
    old_keys, healthy = _old_catalog(root)
    if healthy and not force:
        raise UsageError(f"the catalog of {root} is healthy; nothing to rebuild", hint="pass --force to rebuild anyway")
    report = RebuildReport()
    header = PromptFormat.for_tokenizer(lm.tokenizer).header
    with _write_lock(root):
        groups, others = _scan(root / "objects", report)
        complete = {}
        for key, chunks in groups.items():
            n = {m.get("n_chunks") for _, m, *_ in chunks.values()}
            if len(n) != 1 or set(chunks) != set(range(n.pop() or 0)):
                report.skipped.append(f"{key[0]}@{key[1]}/{key[2]}: chunks missing; version not rebuilt")
            else:
                complete[key] = _version(key, chunks)
        # text objects: each candidate text's document version, derived as ingest derives it
        wanted: dict[tuple, str] = {}
        for (doc_id, dv, _), v in sorted(complete.items(), key=lambda kv: kv[1].parent is not None):
            r = _ingest_recipe(v.recipe)
            if r is not None and v.fingerprint == lm.fingerprint and (doc_id, dv) not in wanted:
                wanted[(doc_id, dv)] = json.dumps(r, sort_keys=True)
        by_dv = {}
        for text_sha in others:
            for recipe in set(wanted.values()):
                try:
                    by_dv[doc_version_of(text_sha, lm.fingerprint, json.loads(recipe), header)] = text_sha
                except (KeyError, TypeError):
                    continue  # not an ingest recipe this kdnctl wrote
        docs = []
        texts = set(others)
        for (doc_id, dv), recipe in sorted(wanted.items()):
            full = [v for (d, x, _), v in complete.items() if (d, x) == (doc_id, dv) and v.parent is None]
            # bundles written since they name their text: trusted once the version derives from it
            first = groups[(doc_id, dv, full[0].label)][0][1] if full else {}
            named, content = first.get("text_object"), first.get("content_sha256")
            if named in texts and is_sha(content) and doc_version_of(content, lm.fingerprint, json.loads(recipe),
                                                                        header) == dv:
                text = named
            else:
                text = content = by_dv.get(dv)
            if text is None or not full:
                report.skipped.append(f"{doc_id}@{dv}: its text object (or full version) is not in the store")
                continue
            docs.append(DocumentRecord(doc_id, dv, content, REBUILT_SOURCE, full[0].n_tokens, full[0].fingerprint,
                                       text, max(v.created for (d, x, _), v in complete.items() if (d, x) == (doc_id, dv))))
        kept = {(d.doc_id, d.doc_version) for d in docs}
        for key in complete:
            if key[:2] not in kept:
                report.skipped.append(f"{key[0]}@{key[1]}/{key[2]}: made with another model or without its text")
        new_keys = {f"{k[0]}@{k[1]}/{k[2]}" for k in complete if k[:2] in kept}
        report.dropped = sorted((old_keys or set()) - new_keys)
        if report.dropped and not force:
            listed = ", ".join(report.dropped[:3]) + (" ..." if len(report.dropped) > 3 else "")
            raise UsageError(f"rebuilding would drop {len(report.dropped)} of the {len(old_keys)} version(s) the present "
                             f"catalog holds ({listed}); nothing was changed",
                             hint="run `kdnctl verify`; pass --force to rebuild anyway (the old catalog is kept aside)")
        store_id = _store_id(root / "objects")
        old = root / "catalog"
        if old.exists():
            report.damaged_catalog = str(root / f"catalog.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
            os.rename(old, report.damaged_catalog)
        cat.create_catalog(old, store_id)
    with Store(root, create=False) as st, st.writer():
        for d in sorted(docs, key=lambda d: d.created):  # the newest version of a document ends current
            labels = sorted((v for k, v in complete.items() if k[:2] == (d.doc_id, d.doc_version)),
                            key=lambda v: (v.parent is not None, v.label))
            st.commit_document(d, labels[0])
            for v in labels[1:]:
                st.commit_version(v)
            report.versions += len(labels)
            if d.doc_id not in report.documents:
                report.documents.append(d.doc_id)
        from kdnctl.quant.store_basis import recover_basis_records

        report.bases = recover_basis_records(st, [root / "objects" / s[:2] / s for s in others])
        report.held = st.hold_unreferenced("not recovered by rebuild-catalog")
    return report
