"""Issue 10 items 4 and 5 with the real model: version records are cross-checked with their
bundles (locally, over --remote, on pull), and gc's grace period keeps a reader's objects."""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import asdict

import lmdb
import pytest
from conftest import EXAMPLES
from httpkit import ThreadServer

from kdnctl.store.client import RemoteStore, mirror
from kdnctl.ingest.corpus import Document
from kdnctl.engine.hf import load_document
from kdnctl.errors import NotFoundError, StoreCorruptError
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.store import Store

pytestmark = pytest.mark.model


def _doc(doc_id: str, text: str) -> Document:
    import hashlib

    return Document(doc_id=doc_id, text=text, source=f"/src/{doc_id}",
                    content_sha256=hashlib.sha256(text.encode()).hexdigest())


@pytest.fixture
def two_docs(tmp_path, lm):
    words = (EXAMPLES / "faq.md").read_text().split()
    root = tmp_path / "kdn"
    with Store(root) as st:
        ingest_documents(st, lm, [_doc("a.md", " ".join(words[:60])), _doc("b.md", " ".join(words[60:130]))],
                         IngestOptions(chunk_tokens=16, stats=False))
    return root


def _tamper(root, doc_id: str, other: str, index: int = 2) -> None:
    """Point chunk ``index`` of doc_id's version at the same-index chunk of ``other``: a record that
    still parses, written without a checksum (as a pre-checksum catalog would hold it)."""
    with Store(root, create=False) as st:
        v, w = st.get_version(doc_id), st.get_version(other)
    rec = asdict(v)
    rec["chunks"][index]["object"] = w.chunks[index].object
    rec["chunks"][index]["nbytes"] = w.chunks[index].nbytes
    rec["chunks"][index]["blake3"] = w.chunks[index].blake3  # the whole reference: its digests too
    rec["chunks"][index]["xxh3"] = w.chunks[index].xxh3
    env = lmdb.open(str(root / "catalog"), max_dbs=8, map_size=1 << 30)
    with env.begin(write=True) as txn:
        txn.put(f"{doc_id}\x00{v.doc_version}\x00full".encode(), json.dumps(rec).encode(),
                db=env.open_db(b"versions", txn=txn))
    env.close()


def test_version_pointing_at_another_documents_chunk_is_refused(two_docs, lm, tmp_path):
    with Store(two_docs, create=False) as st:
        assert st.verify() == []
        good = load_document(lm, st, "a.md")
    _tamper(two_docs, "a.md", "b.md")
    with Store(two_docs, create=False) as st:
        problems = st.verify()
        assert any("a.md" in p and "chunk 2" in p and "doc_id='b.md'" in p for p in problems), problems
        with pytest.raises(StoreCorruptError, match="does not match its bundle.*chunk 2"):
            load_document(lm, st, "a.md")
    with ThreadServer(two_docs) as srv, RemoteStore(srv.url) as remote:
        with pytest.raises(StoreCorruptError, match="does not match its bundle"):
            load_document(lm, remote, "a.md")
        with Store(tmp_path / "mirror") as local:
            with pytest.raises(StoreCorruptError, match="does not match its bundles"):
                mirror(remote, local, ["a.md"])
            assert local.list_documents() == []  # nothing committed
    assert good.n_tokens > 0


def test_gc_grace_keeps_objects_of_a_version_a_reader_picked(two_docs, lm):
    with Store(two_docs, create=False) as st:
        picked = st.get_version("a.md")  # a reader picks the version...
        words = (EXAMPLES / "faq.md").read_text().split()
        ingest_documents(st, lm, [_doc("a.md", " ".join(words[:50]))], IngestOptions(chunk_tokens=16, stats=False))
        assert st.get_version("a.md").doc_version != picked.doc_version  # ...the document changes...
        stats = st.gc()  # ...and gc runs with the default grace period
        assert stats["kept_in_grace"] >= 1 and stats["objects_removed"] == 0
        for c in picked.chunks:  # the reader still finds every object
            st.read_object(c.object)
        ctx = load_document(lm, st, "a.md", doc_version=picked.doc_version)
        assert ctx.n_tokens == picked.n_tokens
        stats = st.gc(grace_s=0)  # once the grace period is over the old version goes
        assert stats["doc_versions_removed"] == 1 and stats["objects_removed"] >= len(picked.chunks)
        assert st.verify() == []


def test_loader_hint_when_a_version_is_reclaimed_under_it(two_docs, lm):
    with Store(two_docs, create=False) as st:
        picked = st.get_version("a.md")
        words = (EXAMPLES / "faq.md").read_text().split()
        ingest_documents(st, lm, [_doc("a.md", " ".join(words[:50]))], IngestOptions(chunk_tokens=16, stats=False))
        st.gc(grace_s=0)
        from kdnctl.engine.hf import load_version

        with pytest.raises(NotFoundError, match="changed while it was being loaded") as exc:
            load_version(lm, st, picked)
        assert "re-ingest" not in exc.value.hint


def test_rebuild_catalog_from_bundles_restores_the_catalog(two_docs, lm):
    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.ingest.rebuild import REBUILT_SOURCE, rebuild_catalog

    words = (EXAMPLES / "faq.md").read_text().split()
    with Store(two_docs, create=False) as st:
        ingest_documents(st, lm, [_doc("b.md", " ".join(words[70:120]))], IngestOptions(chunk_tokens=16, stats=False))
        with st.writer():
            compress_document(st, "a.md", CompressRecipe(budget=None, keep=1.0, quant="int8"), label="q8")
        want = st.catalog_dump()
        current = {d.doc_id: d.doc_version for d in st.list_documents()}
    (two_docs / "catalog" / "data.mdb").write_bytes(b"")  # the issue's `truncate -s 0`
    with pytest.raises(StoreCorruptError):
        Store(two_docs, create=False)
    report = rebuild_catalog(two_docs, lm)
    assert sorted(report.documents) == ["a.md", "b.md"] and report.skipped == []
    assert report.damaged_catalog and (Path(report.damaged_catalog) / "data.mdb").exists()
    with Store(two_docs, create=False) as st:
        got = st.catalog_dump()
        assert st.verify() == []
        assert {d.doc_id: d.doc_version for d in st.list_documents()} == current
        assert all(d["source"] == REBUILT_SOURCE for d in got["docs"].values())
        load_document(lm, st, "a.md", label="q8")
    for d in (want, got):
        for rec in d["docs"].values():
            rec.pop("source")
        d["meta"] = {k: v for k, v in d["meta"].items() if k == "schema_version"}
    assert got == want
