"""Object store + LMDB catalog: atomic objects, checked commits, locking, verify, gc."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kdnctl.errors import NotFoundError, StoreCorruptError, StoreLockedError, UsageError
from storekit import FP, add_doc, add_label, chain

from kdnctl.store import (
    ChunkRef,
    DocumentRecord,
    Store,
    VersionRecord,
    default_store_root,
)

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "kdn")
    yield s
    s.close()


# -- objects ----------------------------------------------------------------------------------

def test_put_and_read_object(store):
    data = b"some bundle bytes" * 100
    with store.writer():
        sha = store.put_object(data)
        assert store.put_object(data) == sha  # idempotent
    assert sha == hashlib.sha256(data).hexdigest()
    assert store.object_path(sha) == store.root / "objects" / sha[:2] / sha
    assert store.object_path(sha).read_bytes() == data
    assert store.has_object(sha) and store.read_object(sha) == data
    assert list((store.root / "tmp").iterdir()) == []  # no temp file left behind
    assert not store.has_object("0" * 64)


def test_read_object_detects_damage(store):
    sha = store.put_object(b"payload-123")
    p = store.object_path(sha)
    p.write_bytes(b"payload-124")
    with pytest.raises(StoreCorruptError, match=f"object {sha[:12]} is corrupted"):
        store.read_object(sha)
    assert store.read_object(sha, verify=False) == b"payload-124"
    # putting the same content again repairs the damaged copy instead of trusting it
    assert store.put_object(b"payload-123") == sha and store.read_object(sha) == b"payload-123"
    p.unlink()
    with pytest.raises(StoreCorruptError, match="missing"):
        store.read_object(sha)
    with pytest.raises(UsageError, match="invalid object id"):
        store.object_path("../../etc/passwd")


# -- verify -----------------------------------------------------------------------------------

def test_verify_healthy_then_flipped_truncated_and_deleted_objects(store):
    doc, ver = add_doc(store, chunks=(b"chunk-zero-bytes", b"chunk-one-bytes", b"chunk-two-bytes"))
    assert store.verify() == []
    c0, c1, c2 = (c.object for c in ver.chunks)

    p = store.object_path(c0)
    raw = bytearray(p.read_bytes())
    raw[3] ^= 0x01
    p.write_bytes(bytes(raw))
    p = store.object_path(c1)
    p.write_bytes(p.read_bytes()[:-5])
    store.object_path(c2).unlink()

    problems = store.verify()
    assert len(problems) == 3, problems
    assert any(c0[:12] in m and "corrupted" in m and "doc-a" in m and "chunk 0" in m for m in problems)
    assert any(c1[:12] in m and "corrupted" in m and "chunk 1" in m for m in problems)
    assert any(c2[:12] in m and "missing" in m and "chunk 2" in m for m in problems)


def test_verify_reports_tmp_and_orphans_as_info_only(store):
    add_doc(store)
    (store.root / "tmp" / "leftover.tmp").write_bytes(b"partial")
    store.put_object(b"orphan object")
    rep = store.verify_report()
    assert rep.problems == []
    assert any("1 unreferenced object" in m for m in rep.info)
    assert any("1 temp file" in m for m in rep.info)
    assert rep.n_objects == 4  # text, 2 chunks, orphan


# -- commits ----------------------------------------------------------------------------------

def test_commit_refuses_missing_objects_and_leaves_catalog_unchanged(store):
    doc, ver = add_doc(store)
    before = store.catalog_dump()
    ghost = "ab" * 32
    with store.writer():
        bad = VersionRecord(doc.doc_id, doc.doc_version, "kv50", "full", {}, FP,
                            [ChunkRef(0, ver.chunks[0].object, 0, 4, chain(0), 2), ChunkRef(1, ghost, 4, 8, chain(1), 2)],
                            time.time(), 8)
        with pytest.raises(StoreCorruptError, match=f"1 referenced object.*{ghost[:12]}"):
            store.commit_version(bad)
        doc2 = DocumentRecord("doc-b", "v9", "a" * 64, "/src/b", 4, FP, ghost, time.time())
        ver2 = VersionRecord("doc-b", "v9", "full", None, {}, FP, [], time.time(), 4)
        with pytest.raises(StoreCorruptError, match=ghost[:12]):
            store.commit_document(doc2, ver2)
    assert store.catalog_dump() == before
    with pytest.raises(NotFoundError, match="kv50"):
        store.get_version("doc-a", "kv50")


def test_commit_requires_writer_lock(store):
    doc, ver = add_doc(store)
    with pytest.raises(StoreLockedError, match="requires the store's writer lock"):
        store.commit_version(ver)
    with pytest.raises(StoreLockedError, match="requires the store's writer lock"):
        store.commit_document(doc, ver)


def test_commit_version_needs_existing_document(store):
    with store.writer():
        sha = store.put_object(b"x")
        v = VersionRecord("nope", "v1", "full", None, {}, FP, [ChunkRef(0, sha, 0, 1, chain(0), 1)], 0.0, 1)
        with pytest.raises(NotFoundError, match="nope"):
            store.commit_version(v)


def test_records_round_trip_and_listing(store):
    doc, ver = add_doc(store)
    add_doc(store, "doc-b", b"other text", (b"b0",), salt="b")
    assert store.get_document("doc-a") == doc
    got = store.get_version("doc-a")
    assert got == ver and got.nbytes == sum(c.nbytes for c in ver.chunks) and got.mode == "prefix"
    assert [d.doc_id for d in store.list_documents()] == ["doc-a", "doc-b"]
    assert sorted((v.doc_id, v.label) for v in store.list_versions()) == [("doc-a", "full"), ("doc-b", "full")]
    assert store.find_document("doc-a", doc.content_sha256) == doc
    assert store.find_document("doc-a", "0" * 64) is None


# -- locking ----------------------------------------------------------------------------------

LOCK_PROBE = textwrap.dedent("""
    import sys
    from kdnctl.store import Store
    from kdnctl.errors import StoreLockedError
    s = Store(sys.argv[1], create=False)
    print("reader sees", s.get_document("doc-a").doc_id, flush=True)  # readers need no lock
    try:
        with s.writer():
            print("ACQUIRED", flush=True)
    except StoreLockedError as e:
        print("LOCKED", e.message, flush=True)
""")


def test_second_writer_in_another_process_gets_store_locked_error(store):
    add_doc(store)
    with store.writer():
        out = subprocess.run([PY, "-c", LOCK_PROBE, str(store.root)], capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert "reader sees doc-a" in out.stdout
        assert f"LOCKED store {store.root} is locked by another writer (pid {os.getpid()})" in out.stdout
        # a second Store instance in this process is a second writer too
        other = Store(store.root, create=False)
        with pytest.raises(StoreLockedError):
            with other.writer():
                pass
        other.close()
        with store.writer():  # re-entrant for the holder
            pass
    out = subprocess.run([PY, "-c", LOCK_PROBE, str(store.root)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert "ACQUIRED" in out.stdout, out.stdout + out.stderr


def test_lock_held_by_other_process_blocks_us(store):
    add_doc(store)
    holder = subprocess.Popen(
        [PY, "-c", "import sys; from kdnctl.store import Store; s = Store(sys.argv[1]);\n"
                   "with s.writer():\n print('held', flush=True); sys.stdin.readline()", str(store.root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreLockedError, match=f"pid {holder.pid}"):
            with store.writer():
                pass
        assert store.get_version("doc-a").label == "full"  # reads still work
    finally:
        holder.communicate("\n", timeout=60)
    with store.writer():
        pass


# -- document versions, gc ------------------------------------------------------------------

def test_changed_document_gets_new_version_with_independent_labels(store):
    d1, v1 = add_doc(store, text=b"first text", chunks=(b"shared", b"old-1"))
    add_label(store, d1, "kv50", (b"old-pruned",))
    d2, v2 = add_doc(store, text=b"second text", chunks=(b"shared", b"new-1"), salt="2")
    assert d2.doc_version != d1.doc_version
    assert store.get_document("doc-a") == d2
    assert [d.doc_version for d in store.document_history("doc-a")] == [d1.doc_version, d2.doc_version]
    assert store.get_version("doc-a", "kv50", doc_version=d1.doc_version).label == "kv50"
    with pytest.raises(NotFoundError) as exc:
        store.get_version("doc-a", "kv50")  # the label belonged to the old content
    assert exc.value.hint == "labels stored for doc-a: full"
    assert [v.doc_version for v in store.list_versions("doc-a")] == [d2.doc_version]


def test_gc_removes_superseded_versions_and_orphans_but_keeps_current(store):
    # independent chunks are document-neutral, so two versions may share one ("shared")
    d1, v1 = add_doc(store, text=b"first text", chunks=(b"shared", b"old-1"), mode="independent")
    kv = add_label(store, d1, "kv50", (b"old-pruned",), salt="p")
    d2, v2 = add_doc(store, text=b"second text", chunks=(b"shared", b"new-1"), mode="independent",
                     salt="")
    orphan = store.put_object(b"nobody refers to me")
    os.utime(store.object_path(orphan), (time.time() - 3600, time.time() - 3600))  # older than the last commit
    time.sleep(0.02)  # file times are coarser than the commit's clock
    fresh = store.put_object(b"written after the last commit")  # a writer between put and commit
    old_tmp, new_tmp = store.root / "tmp" / "old.tmp", store.root / "tmp" / "new.tmp"
    old_tmp.write_bytes(b"12345")
    new_tmp.write_bytes(b"live")
    os.utime(old_tmp, (time.time() - 3600, time.time() - 3600))

    before = store.catalog_dump()
    dry = store.gc(dry_run=True, grace_s=0)
    assert store.catalog_dump() == before and store.has_object(orphan) and old_tmp.exists()

    size = lambda sha: store.object_path(sha).stat().st_size  # noqa: E731
    gone = [d1.text_object, v1.chunks[1].object, kv.chunks[0].object, orphan]
    freed = sum(size(s) for s in gone) + 5
    stats = store.gc(grace_s=0)
    assert stats == dict(dry, dry_run=False)
    assert stats["doc_versions_removed"] == 1 and stats["versions_removed"] == 2
    assert stats["prefix_entries_removed"] == 3  # v1 full: 2 chunks, kv50: 1 chunk
    assert stats["objects_removed"] == 4 and stats["tmp_removed"] == 1  # text, old-1, old-pruned, orphan
    assert stats["bytes_freed"] == freed
    for sha in gone:
        assert not store.has_object(sha)
    assert stats["kept_newer"] == 1 and store.has_object(fresh)  # newer than the catalog's last commit
    assert store.has_object(v2.chunks[0].object)  # "shared" is still used by the current version
    assert store.has_object(d2.text_object) and store.has_object(v2.chunks[1].object)
    assert not old_tmp.exists() and new_tmp.exists()
    assert [d.doc_version for d in store.document_history("doc-a")] == [d2.doc_version]
    assert store.lookup_chunk(FP, "kv50", chain(0, "p")) is None
    new_tmp.unlink()
    assert store.verify() == []
    assert store.gc(grace_s=0)["objects_removed"] == 0  # nothing left to collect


def test_remove_document_then_gc_reclaims_everything(store):
    add_doc(store)
    with store.writer():
        store.remove_document("doc-a")
        with pytest.raises(NotFoundError):
            store.remove_document("doc-a")
    assert store.list_documents() == []
    assert store.gc(grace_s=0)["objects_removed"] == 3
    assert list((store.root / "objects").rglob("*.*")) == [] and store.verify() == []


# -- lookup, dump, errors --------------------------------------------------------------------

def test_lookup_chunk(store):
    d, v = add_doc(store)
    hit = store.lookup_chunk(FP, "full", chain(1))
    assert hit is not None
    rec, ref = hit
    assert (rec.doc_id, rec.label, ref.index, ref.object) == ("doc-a", "full", 1, v.chunks[1].object)
    assert store.lookup_chunk(FP, "full", chain(7)) is None
    assert store.lookup_chunk("e" * 64, "full", chain(1)) is None  # other model
    assert store.lookup_chunk(FP, "kv50", chain(1)) is None  # other label
    # a second document sharing the first chunk: the entry resolves to a current document
    add_doc(store, "doc-b", b"text b", (b"c0",))
    rec, ref = store.lookup_chunk(FP, "full", chain(0))
    assert ref.object == v.chunks[0].object and rec.doc_id in {"doc-a", "doc-b"}


def test_chunk_sizes_of_current_versions(store):
    assert store.chunk_sizes() == []
    d, _ = add_doc(store)  # recipe chunk_tokens=4
    with store.writer():
        sha = store.put_object(b"z")
        store.commit_version(VersionRecord(d.doc_id, d.doc_version, "odd", None, {}, FP,
                                           [ChunkRef(0, sha, 0, 16, chain(0, "z"), 1)], 0.0, 16))
    assert store.chunk_sizes() == [4, 16]  # the second one from its first chunk's length


def test_recommitting_a_label_replaces_its_prefix_entries(store):
    d, _ = add_doc(store)
    add_label(store, d, "kv50", (b"p0", b"p1"), salt="x")
    add_label(store, d, "kv50", (b"p0",), salt="y")
    assert store.lookup_chunk(FP, "kv50", chain(1, "x")) is None
    assert store.lookup_chunk(FP, "kv50", chain(0, "y")) is not None
    assert [k for k in store.catalog_dump()["prefix"] if "/kv50/" in k] == [f"{FP}/kv50/{chain(0, 'y')}/doc-a/{d.doc_version}"]
    assert store.verify() == []


def test_catalog_dump_equal_for_stores_built_the_same_way(tmp_path):
    a, b = Store(tmp_path / "a"), Store(tmp_path / "b")
    for s, created in ((a, 1000.0), (b, 2000.0)):  # timestamps differ, content does not
        d, _ = add_doc(s, created=created)
        add_label(s, d, "kv50", (b"pruned",))
        add_doc(s, "doc-b", b"bbb", (b"x",), created=created)
    da = a.catalog_dump()
    assert da == b.catalog_dump()
    assert da["meta"] == {"schema_version": 1, "last_commit": {}}  # (each store's own id is left out)
    assert set(da) == {"meta", "docs", "current", "versions", "prefix"}
    assert len(da["versions"]) == 3 and len(da["prefix"]) == 4
    assert all("created" not in v for v in da["docs"].values())
    add_label(b, b.get_document("doc-b"), "q4", (b"q",))
    assert a.catalog_dump() != b.catalog_dump()
    a.close()
    b.close()


def test_not_found_errors_carry_hints(tmp_path, store):
    with pytest.raises(NotFoundError) as exc:
        Store(tmp_path / "missing", create=False)
    assert "kdnctl ingest" in exc.value.hint and not (tmp_path / "missing").exists()
    with pytest.raises(NotFoundError, match="'nope' is not in the store") as exc:
        store.get_document("nope")
    assert "kdnctl ls" in exc.value.hint
    d, _ = add_doc(store)
    add_label(store, d, "kv50", (b"p",))
    with pytest.raises(NotFoundError, match="no version labelled 'q4'") as exc:
        store.get_version("doc-a", "q4")
    assert exc.value.hint == "labels stored for doc-a: full, kv50"


def test_two_instances_share_the_catalog_and_close_independently(store):
    add_doc(store)
    other = Store(store.root, create=False)
    assert other.get_document("doc-a").doc_id == "doc-a"
    other.close()
    assert store.get_version("doc-a").label == "full"  # our instance still works


def test_default_store_root(monkeypatch):
    monkeypatch.delenv("KDN_STORE", raising=False)
    assert default_store_root() == Path(".kdn")
    monkeypatch.setenv("KDN_STORE", "/data/kv")
    assert default_store_root() == Path("/data/kv")


def test_ids_are_validated(store):
    with store.writer():
        sha = store.put_object(b"t")
        doc = DocumentRecord("bad\x00id", "v1", "x", "s", 1, FP, sha, 0.0)
        ver = VersionRecord("bad\x00id", "v1", "full", None, {}, FP, [], 0.0, 1)
        with pytest.raises(UsageError, match="doc_id"):
            store.commit_document(doc, ver)
