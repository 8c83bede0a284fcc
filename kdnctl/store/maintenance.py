"""`verify` (check every record, object and bundle) and `gc` (reclaim, with a grace period).

gc deletes only what a trusted catalog proves unreferenced (docs/store.md, "Safety"):
- the catalog must carry this store's id, the one written beside the objects at creation;
- verify's record checks must pass: a record that is damaged, points at a missing object or at
  a bundle that names another place, might have been any object's rightful owner, so gc
  refuses and deletes nothing;
- an unreferenced object newer than the catalog's last commit is kept (the catalog may be an
  older backup, or a writer is between writing objects and committing them);
- objects ``rebuild-catalog`` could not place are held (``held`` entries) until released.
Superseded document versions and labels replaced by a re-commit keep their objects for
``grace_s`` seconds after they stopped being current, so a reader (a load, a `pull`) that
picked a version just before keeps its objects.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import lmdb

from kdnctl.errors import BundleFormatError, KdnError, StoreCorruptError

from . import bases
from . import catalog as cat
from . import profiles
from .records import CATALOG_HINT, SHA_RE, VersionRecord, bundle_mismatch

DEFAULT_GRACE_S = 600.0  # superseded objects stay this long after they stopped being current
TMP_GRACE_S = 600.0  # a tmp file of a live (or unknown) writer is left alone this long
# An object written this close before the last commit counts as newer (file times are coarser
# than the clock the commit reads).
COMMIT_SLACK_S = 0.0
META_KEYS = ("schema_version", "store_id", "last_commit")  # plain meta keys; the rest are prefixed
SEGMENT_RE = re.compile(r"#\d+$")  # a segment of a document longer than the model's context


@dataclass
class VerifyReport:
    problems: list[str] = field(default_factory=list)  # anything that makes data unusable
    info: list[str] = field(default_factory=list)  # harmless findings (orphans, tmp files)
    n_objects: int = 0
    n_bytes: int = 0
    n_records: int = 0


def _show(k: bytes) -> str:
    return repr(k.replace(b"\x00", b"/"))[2:-1][:80]


def _time_of(raw: bytes) -> float:
    val = json.loads(raw)
    t = val.get("created") if isinstance(val, dict) else None
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        raise StoreCorruptError(f"catalog bookkeeping entry holds {str(val)[:40]!r}", hint=CATALOG_HINT)
    return float(t)


def object_files(store) -> Iterator[Path]:
    if store.objects_dir.is_dir():
        for sub in sorted(store.objects_dir.iterdir()):
            if sub.is_dir():
                yield from sorted(p for p in sub.iterdir() if p.is_file())


def _key_basis_problem(meta: dict, seen: dict[str, str | None], store=None) -> str | None:
    """Why the key basis an ec bundle's keys are coded in (format 1.7) cannot be read here, or None:
    the bundle itself is intact, but it would not load. A basis the store holds counts."""
    sha = (meta.get("quant") or {}).get("key_basis") if isinstance(meta.get("quant"), dict) else None
    if sha is None:
        return None
    if sha not in seen:
        from kdnctl.format.key_basis import decode_basis, known, load_basis

        try:
            if not known(sha) and store is not None and SHA_RE.match(str(sha)) and store.has_object(sha):
                data = store.object_path(sha).read_bytes()
                if hashlib.sha256(data).hexdigest() != sha:
                    raise BundleFormatError(f"key basis object {sha[:12]} is corrupted (hash mismatch)")
                decode_basis(data, f"key basis object {sha[:12]}")
            else:
                load_basis(sha)
            seen[sha] = None
        except BundleFormatError as e:
            seen[sha] = f"needs key basis {str(sha)[:12]}: {e.message}" + (f" ({e.hint})" if e.hint else "")
    return seen[sha]


def check_head(head: bytes, total: int) -> dict:
    """A bundle's metadata after every check its header allows without its payload: JSON,
    format version, tensor index (against the bundle's length ``total``) and header digest."""
    from kdnctl.format.bundle import parse_head
    from kdnctl.format.layout import Layout

    meta, meta_json, digest, n, index = parse_head(head, total)
    if digest is not None:
        try:
            computed = Layout(index, total - 8 - n).digest(meta_json)
        except UnicodeEncodeError:
            raise BundleFormatError("bundle metadata is not valid UTF-8 (corrupted?)") from None
        if digest != computed:
            raise BundleFormatError("bundle header checksum mismatch (corrupted metadata or tensor index)")
    return meta


def _bundle_meta(path: Path, *, full: bool = True) -> dict:
    """The bundle's metadata after the checks a load makes: with ``full``, the whole decoder
    (header, tensor index, digest, every tensor's structure); else the header-only ones."""
    from kdnctl.format.bundle import decode_bundle, header_size

    with open(path, "rb") as f:
        if full:
            return decode_bundle(bytearray(f.read())).meta
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        head += f.read(header_size(head) - 8)
        return check_head(head, size)


def hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _dead_writer(p: Path) -> bool:
    """True if tmp file ``p`` was written by a process of this host that no longer runs."""
    parts = p.name.split(".")
    if len(parts) != 5 or parts[1] != socket.gethostname()[:32] or not parts[2].isdigit():
        return False  # another host, or an old name: only its age can tell
    pid = int(parts[2])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Maintenance:
    """verify and gc, a mixin of Store (needs its catalog reader and object layout)."""

    def verify_report(self, *, check_bundles: bool = True, rehash: bool = True) -> VerifyReport:
        """Check every catalog record, object and bundle header (docs/reliability.md).
        ``rehash=False`` (gc) skips re-hashing object bytes: a corrupted object that a record
        uses is never deleted anyway; everything else is checked."""
        rep = VerifyReport()
        bad = rep.problems.append
        docs: dict[tuple, Any] = {}
        versions: dict[tuple, VersionRecord] = {}
        n_held = 0
        basis_recs: list[bases.BasisRecord] = []
        try:
            with self._env.begin() as txn:
                for k, v in self._scan(txn, "docs"):
                    rep.n_records += 1
                    try:
                        d = self._doc(k, v)
                        docs[(d.doc_id, d.doc_version)] = d
                    except (KdnError, ValueError, UnicodeDecodeError, RecursionError) as e:
                        bad(f"document entry {_show(k)}: {getattr(e, 'message', e)}")
                for k, v in self._scan(txn, "versions"):
                    rep.n_records += 1
                    try:
                        r = self._version(k, v)
                    except (KdnError, ValueError, UnicodeDecodeError, RecursionError) as e:
                        bad(f"version entry {_show(k)}: {getattr(e, 'message', e)}")
                        continue
                    versions[(r.doc_id, r.doc_version, r.label)] = r
                    if (r.doc_id, r.doc_version) not in docs:
                        bad(f"version {r.doc_id}@{r.doc_version}/{r.label} has no document record")
                for k, v in self._scan(txn, "current"):
                    rep.n_records += 1
                    try:
                        parts, dv = cat.split(k), json.loads(v)
                    except (ValueError, UnicodeDecodeError):
                        bad(f"current entry {_show(k)} is unreadable")
                        continue
                    if len(parts) != 1 or not isinstance(dv, str) or (parts[0], dv) not in docs:
                        bad(f"current version of {_show(k)} points at a missing document record")
                for k, v in self._scan(txn, "prefix"):
                    rep.n_records += 1
                    try:
                        parts, entry = cat.split(k), json.loads(v)
                        fp, label, chain, doc_id, dv = parts
                        idx = entry["index"]
                    except (ValueError, UnicodeDecodeError, TypeError, KeyError):
                        bad(f"prefix entry {_show(k)} is unreadable")
                        continue
                    r = versions.get((doc_id, dv, label))
                    c = r.chunk(idx) if r is not None and isinstance(idx, int) else None
                    if c is None or c.chain_hash != chain or r.fingerprint != fp:
                        bad(f"dangling prefix entry {chain[:12]} -> {doc_id}@{dv}/{label} chunk {idx}")
                for k, v in self._scan(txn, "meta"):
                    rep.n_records += 1
                    try:
                        kind = cat.split(k)[0]
                        if kind in ("retired", "released", "held"):
                            _time_of(v)
                            n_held += kind == "held"
                        elif kind == bases.KIND:
                            basis_recs.append(bases.parse(cat.split(k), v))
                        elif kind == profiles.KIND:  # a record that reads is all a profile needs
                            profiles.parse(cat.split(k), v)
                        elif kind not in META_KEYS:
                            bad(f"unknown catalog meta entry {_show(k)}")
                    except (KdnError, ValueError, UnicodeDecodeError):
                        bad(f"catalog meta entry {_show(k)} is unreadable")
        except lmdb.Error as e:
            bad(f"the catalog cannot be read ({type(e).__name__}: {e})")
        refs: dict[str, list[str]] = {}
        for d in docs.values():
            refs.setdefault(d.text_object, []).append(f"text of {d.doc_id}@{d.doc_version}")
            if d.text_object != d.content_sha256 and not SEGMENT_RE.search(d.doc_id):
                bad(f"document {d.doc_id}@{d.doc_version} names text object {d.text_object[:12]} but its content "
                    f"hash is {d.content_sha256[:12]} (the record points at another text)")
        for r in versions.values():
            for c in r.chunks:
                refs.setdefault(c.object, []).append(f"{r.doc_id}@{r.doc_version}/{r.label} chunk {c.index}")
        for b in basis_recs:
            refs.setdefault(b.object, []).append(f"key basis of model {b.fingerprint[:12]}")
        present: set[str] = set()
        for p in object_files(self):
            if not SHA_RE.match(p.name) or p.parent.name != p.name[:2]:
                rep.info.append(f"unexpected file in objects/: {p.relative_to(self.root)}")
                continue
            rep.n_objects += 1
            rep.n_bytes += p.stat().st_size
            if rehash and hash_file(p) != p.name:
                used = refs.get(p.name)
                where = f"used by {'; '.join(used[:3])}" if used else "unreferenced"
                bad(f"object {p.name[:12]} is corrupted (hash mismatch), {where}")
                continue
            present.add(p.name)
        for sha, used in sorted(refs.items()):
            if sha not in present and not any(f"object {sha[:12]} is corrupted" in q for q in rep.problems):
                bad(f"object {sha[:12]} is missing, used by {'; '.join(used[:3])}")
        if check_bundles:
            for b in basis_recs:  # a recorded basis is a basis file that names its model (hash checked above)
                if b.object in present:
                    try:
                        is_basis, fp = bases.file_fingerprint(self.object_path(b.object).read_bytes())
                    except OSError as e:
                        is_basis, fp = False, str(e)
                    if not is_basis or fp != b.fingerprint:
                        bad(f"key basis of model {b.fingerprint[:12]}: object {b.object[:12]} is not that model's "
                            "key basis file")
            metas: dict[str, dict | str] = {}
            seen_bases: dict[str, str | None] = {}  # key basis sha -> why it cannot be read (None: fine)
            for r in versions.values():
                for c in r.chunks:
                    if c.object not in present:
                        continue
                    if c.object not in metas:
                        try:
                            metas[c.object] = _bundle_meta(self.object_path(c.object), full=rehash)
                        except (BundleFormatError, OSError) as e:
                            metas[c.object] = getattr(e, "message", str(e))
                    meta = metas[c.object]
                    if isinstance(meta, str):
                        bad(f"{r.doc_id}@{r.doc_version}/{r.label} chunk {c.index}: object {c.object[:12]} is not "
                            f"a readable bundle ({meta})")
                        continue
                    why = bundle_mismatch(r, c, meta)
                    if why:
                        bad(why)
                    elif (basis := _key_basis_problem(meta, seen_bases, self)) is not None:
                        bad(f"{r.doc_id}@{r.doc_version}/{r.label} chunk {c.index}: object {c.object[:12]} {basis}")
            for d in docs.values():  # bundles that name their text must name this record's
                full = versions.get((d.doc_id, d.doc_version, "full"))
                first = full.chunk(0) if full is not None and full.mode == "prefix" else None
                meta = metas.get(first.object) if first is not None else None
                named = meta.get("text_object") if isinstance(meta, dict) else None
                if named is not None and named != d.text_object:
                    bad(f"document {d.doc_id}@{d.doc_version} names text object {d.text_object[:12]} but its bundles "
                        f"name {str(named)[:12]} (the record points at another text)")
        orphans = len(present - set(refs))
        if orphans:
            rep.info.append(f"{orphans} unreferenced object(s) (`kdnctl gc` removes those older than the catalog's "
                            "last commit and not held)")
        if n_held:
            rep.info.append(f"{n_held} object(s) held by rebuild-catalog (gc keeps them; `kdnctl gc --release-held` "
                            "lets it remove the unreferenced ones)")
        tmps = [p for p in self.tmp_dir.iterdir() if p.is_file()] if self.tmp_dir.is_dir() else []
        if tmps:
            size = sum(p.stat().st_size for p in tmps)
            dead = sum(1 for p in tmps if _dead_writer(p))
            rep.info.append(f"{len(tmps)} temp file(s) in tmp/, {size} bytes, {dead} left by a writer that is gone "
                            "(interrupted writes; `kdnctl gc` removes those)")
        return rep

    def hold_unreferenced(self, reason: str) -> int:
        """Mark every object no record uses as held: gc keeps it until ``gc(release_held=True)``
        (what a rebuilt catalog could not place may still be someone's data)."""
        from .reads import dumps_json

        self._require_writer("hold_unreferenced")
        refs = {d.text_object for d in self._all_documents()}
        refs.update(c.object for v in self.all_versions() for c in v.chunks)
        refs.update(b.object for b in bases.basis_records(self))
        loose = [p.name for p in object_files(self) if SHA_RE.match(p.name) and p.name not in refs]
        with self._env.begin(write=True) as txn:
            for sha in loose:
                txn.put(cat.key("held", sha), dumps_json({"created": time.time(), "reason": reason}), db=self._db["meta"])
        return len(loose)

    def verify(self) -> list[str]:
        return self.verify_report().problems

    def gc(self, *, dry_run: bool = False, grace_s: float | None = None,
           tmp_grace_s: float | None = None, release_held: bool = False) -> dict:
        """Drop superseded doc versions (after the grace period), then unreferenced objects and
        stale tmp files. Holds the writer lock so no writer is between put_object and commit."""
        grace = DEFAULT_GRACE_S if grace_s is None else float(grace_s)
        tmp_grace = TMP_GRACE_S if tmp_grace_s is None else float(tmp_grace_s)
        with self.writer():
            self.check_identity("gc")
            checked = self.verify_report(check_bundles=True, rehash=False)
            if checked.problems:
                n = len(checked.problems)
                raise StoreCorruptError(
                    f"gc refuses: {n} catalog record(s) fail verify's checks (first: {checked.problems[0][:200]}); "
                    "a damaged record may own any object, so nothing was deleted",
                    hint="run `kdnctl verify` for the list; restore the catalog or objects it names (or rebuild the "
                         "catalog with `kdnctl rebuild-catalog`), then gc again")
            names = ("doc_versions_removed", "versions_removed", "prefix_entries_removed",
                     "objects_removed", "tmp_removed", "bytes_freed", "kept_in_grace", "kept_newer", "kept_held")
            stats: dict[str, Any] = {"dry_run": dry_run, "grace_s": grace, **dict.fromkeys(names, 0)}
            refs: set[str] = set()  # objects referenced once this txn is done
            now = time.time()
            try:
                with self._env.begin(write=not dry_run) as txn:
                    def drop(db: str, key: bytes, counter: str | None) -> None:
                        if counter:
                            stats[counter] += 1
                        if not dry_run:
                            txn.delete(key, db=self._db[db])

                    # Read and validate EVERYTHING first: a damaged record raises before any delete.
                    current = {}
                    for k, _ in self._scan(txn, "current"):
                        doc_id = cat.split(k)[0]
                        current[doc_id] = self._current(txn, doc_id)
                    doc_recs = [(k, self._doc(k, v)) for k, v in self._scan(txn, "docs")]
                    ver_recs = [(k, self._version(k, v)) for k, v in self._scan(txn, "versions")]
                    prefix_keys = [(k, cat.split(k)) for k, _ in self._scan(txn, "prefix")]
                    retired, released, held, held_keys = {}, {}, set(), []
                    for k, v in self._scan(txn, "meta"):
                        parts = cat.split(k)
                        if parts[0] == "retired" and len(parts) == 3:
                            retired[(parts[1], parts[2])] = (k, _time_of(v))
                        elif parts[0] == "released" and len(parts) == 2:
                            released[parts[1]] = (k, _time_of(v))
                        elif parts[0] == "held" and len(parts) == 2:
                            held_keys.append(k)
                            held.add(parts[1])
                        elif parts[0] == bases.KIND:  # a model's key basis is referenced while recorded
                            refs.add(bases.parse(parts, v).object)
                    if release_held:
                        for k in held_keys:
                            drop("meta", k, None)
                        held = set()
                    created = {(d.doc_id, d.doc_version): d.created for _, d in doc_recs}
                    # objects newer than this are kept: a catalog that predates them cannot judge them
                    last = self.last_commit(txn)
                    if last is None:  # a catalog from before the commit time was kept: its newest record
                        times = [d.created for _, d in doc_recs] + [r.created for _, r in ver_recs]
                        times += [t for _, t in retired.values()] + [t for _, t in released.values()]
                        last = max(times, default=float("-inf"))
                    for doc_id, dv in current.items():
                        if (doc_id, dv) not in created:
                            raise StoreCorruptError(f"current version of {doc_id!r} points at a missing document "
                                                    "record; gc refuses to guess what is referenced", hint=CATALOG_HINT)

                    live_docs = set()
                    for k, d in doc_recs:
                        key = (d.doc_id, d.doc_version)
                        if current.get(d.doc_id) == d.doc_version:
                            live_docs.add(key)
                            continue
                        if key in retired:
                            since = retired[key][1]
                        else:  # written before retire times were kept: the successor's creation
                            since = created.get((d.doc_id, current.get(d.doc_id)), 0.0)
                        if now - since < grace:
                            live_docs.add(key)
                            stats["kept_in_grace"] += 1
                        else:
                            drop("docs", k, "doc_versions_removed")
                            if key in retired:
                                drop("meta", retired.pop(key)[0], None)
                    live_docs_set = live_docs
                    for k, d in doc_recs:
                        if (d.doc_id, d.doc_version) in live_docs_set:
                            refs.add(d.text_object)
                    live_versions = set()
                    for k, r in ver_recs:
                        if (r.doc_id, r.doc_version) in live_docs_set:
                            live_versions.add((r.doc_id, r.doc_version, r.label))
                            refs.update(c.object for c in r.chunks)
                        else:
                            drop("versions", k, "versions_removed")
                    for k, parts in prefix_keys:
                        if len(parts) != 5 or (parts[3], parts[4], parts[1]) not in live_versions:
                            drop("prefix", k, "prefix_entries_removed")
                    for key, (k, _) in retired.items():  # a retire mark of a record already gone
                        if key not in live_docs_set or key[1] == current.get(key[0]):
                            drop("meta", k, None)
                    for sha, (k, t) in released.items():
                        if now - t < grace:
                            if sha not in refs:
                                stats["kept_in_grace"] += 1
                            refs.add(sha)
                        else:
                            drop("meta", k, None)
            except lmdb.Error as e:
                raise StoreCorruptError(f"catalog of {self.root} cannot be read ({e}); gc deleted nothing",
                                        hint=CATALOG_HINT) from None
            except (ValueError, UnicodeDecodeError, TypeError, KeyError, IndexError) as e:
                raise StoreCorruptError(f"catalog of {self.root} is damaged ({type(e).__name__}); gc deleted nothing",
                                        hint=CATALOG_HINT) from None

            def reclaim(p: Path, counter: str) -> None:
                stats[counter] += 1
                stats["bytes_freed"] += p.stat().st_size
                if not dry_run:
                    p.unlink()

            # Files go only after the catalog txn committed: a crash in between leaves
            # unreferenced files (harmless), never a reference to a deleted file.
            for p in object_files(self):
                if SHA_RE.match(p.name) and p.name not in refs:
                    if p.name in held:
                        stats["kept_held"] += 1
                    elif p.stat().st_mtime > last - COMMIT_SLACK_S:
                        stats["kept_newer"] += 1
                    else:
                        reclaim(p, "objects_removed")
            for p in sorted(self.tmp_dir.iterdir()) if self.tmp_dir.is_dir() else []:
                if p.is_file() and (_dead_writer(p) or now - p.stat().st_mtime >= tmp_grace):
                    reclaim(p, "tmp_removed")
            return stats


def bundle_problems(store, version: VersionRecord) -> list[str]:
    """Why chunks of ``version`` do not match their bundles' own metadata (header-only reads)."""
    from .protocol import read_bundle_meta

    out = []
    for c in version.chunks:
        try:
            meta = read_bundle_meta(store, c.object)
        except BundleFormatError as e:
            out.append(f"{version.doc_id}/{version.label} chunk {c.index}: object {c.object[:12]} is not a "
                       f"readable bundle ({e.message})")
            continue
        why = bundle_mismatch(version, c, meta)
        if why:
            out.append(why)
    return out
