"""`rebuild-catalog` on a store made with the default options (real SmolLM2, one short
document): every version (full, the 0.25 and 0.083 defaults, an edit) comes back from the
bundles' metadata and answers as before; a rebuild never silently drops versions; and a load
that gc races ends in the documented retry message. One module-scoped store (its 0.083 compress
is the slow part), copied for each attack."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import cli_json, run_cli
from storekit import GC_CASES

from kdnctl.errors import NotFoundError, StoreCorruptError
from kdnctl.store import Store
from kdnctl.store import catalog as cat
from kdnctl.store.reads import seal_record

pytestmark = pytest.mark.model

DOC = ("The harbour office of Velmora opens at seven. Its keeper, Ansel Brandt, logs every ship by hand in a "
       "green ledger. The ledger code for this season is 4417. Ships from the north unload timber; ships "
       "from the south bring salt and copper. When fog closes the harbour, the keeper rings the brass bell "
       "twice every ten minutes until the fog lifts. The office closes at dusk.")
QUESTION = "What is the ledger code for this season?"
LABELS_MADE = ("full", "b0.25", "b0.083", "edited")


def _answers(root) -> dict[str, str]:
    out = {}
    for label in LABELS_MADE:
        out[label] = cli_json("ask", "harbour.txt", QUESTION, "--version", label, "--max-new-tokens", "8",
                              store=root)["answer"]
    return out


def _listing(root) -> dict:
    return {d["id"]: sorted(v["label"] for v in d["versions"]) for d in cli_json("ls", store=root)["documents"]}


def _referenced(root) -> set[str]:
    with Store(root, create=False) as st:
        dump = st.catalog_dump()
    refs = {d["text_object"] for d in dump["docs"].values()}
    refs.update(c["object"] for v in dump["versions"].values() for c in v["chunks"])
    return refs


def _objects(root) -> set[str]:
    return {p.name for p in (root / "objects").glob("*/*") if p.is_file()}


@pytest.fixture(scope="module")
def default_store(tmp_path_factory, lm):
    base = tmp_path_factory.mktemp("rebuild")
    corpus = base / "harbour.txt"
    corpus.write_text(DOC)
    root = base / "kdn"
    run_cli("ingest", str(corpus), store=root, check=True)  # default options
    run_cli("compress", "harbour.txt", "--budget", "0.25", "--label", "b0.25", store=root, check=True)
    run_cli("compress", "harbour.txt", "--budget", "0.083", "--label", "b0.083", store=root, check=True)
    run_cli("edit", "harbour.txt", "--steer", "ledger code", "--label", "edited", store=root, check=True)
    assert _listing(root) == {"harbour.txt": sorted(LABELS_MADE)}
    return root, _answers(root), _referenced(root)


def _copy(default_store, tmp_path):
    root = tmp_path / "kdn"
    shutil.copytree(default_store[0], root)
    return root


def test_rebuild_after_emptied_catalog_recovers_every_version(default_store, tmp_path):
    root = _copy(default_store, tmp_path)
    _, answers, trusted = default_store
    (root / "catalog" / "data.mdb").write_bytes(b"")  # `: > STORE/catalog/data.mdb`
    proc = run_cli("rebuild-catalog", store=root)
    assert proc.returncode == 0 and "not recovered" not in proc.stderr, proc.stderr
    assert "rebuilt 1 document(s), 4 version(s)" in proc.stderr
    assert run_cli("verify", store=root).returncode == 0
    assert _listing(root) == {"harbour.txt": sorted(LABELS_MADE)}
    assert _referenced(root) == trusted
    assert _answers(root) == answers
    proc = run_cli("gc", "--grace", "0", store=root)
    GC_CASES.append(("rebuild after emptied catalog", len(trusted - _objects(root))))
    assert proc.returncode == 0 and trusted <= _objects(root), proc.stderr


def test_forced_rebuild_of_a_healthy_store_keeps_everything(default_store, tmp_path):
    root = _copy(default_store, tmp_path)
    _, _, trusted = default_store
    proc = run_cli("rebuild-catalog", store=root)
    assert proc.returncode == 2 and "healthy" in proc.stderr
    out = cli_json("rebuild-catalog", "--force", store=root)
    assert out["dropped"] == [] and out["versions"] == 4 and out["skipped"] == []
    assert _referenced(root) == trusted
    proc = run_cli("gc", "--grace", "0", store=root)
    GC_CASES.append(("forced rebuild of a healthy store", len(trusted - _objects(root))))
    assert proc.returncode == 0 and trusted <= _objects(root)


def test_rebuild_that_would_drop_versions_needs_force_and_holds_what_it_drops(default_store, tmp_path):
    root = _copy(default_store, tmp_path)
    _, _, trusted = default_store
    with Store(root, create=False) as st:
        v = st.get_version("harbour.txt", "b0.083")
        lost = v.chunks[0].object
        with st._env.begin(write=True) as txn:  # damage one record: the catalog is no longer healthy
            key = next(k for k, _ in st._scan(txn, "versions") if k.endswith(b"\x00b0.25"))
            txn.put(key, b'{"broken": true}', db=st._db["versions"])
    (root / "objects" / lost[:2] / lost).unlink()  # and b0.083 can no longer be rebuilt
    with Store(root, create=False) as st, st.writer():
        stray = st.put_object(b"bytes no rebuilt record will claim")
    os.utime(root / "objects" / stray[:2] / stray, (1e9, 1e9))  # older than any commit
    before = _objects(root)
    proc = run_cli("rebuild-catalog", store=root)
    assert proc.returncode == 2 and "would drop 1 of the 4 version(s)" in proc.stderr, proc.stderr
    assert _objects(root) == before and not list(root.glob("catalog.damaged-*"))
    out = cli_json("rebuild-catalog", "--force", store=root)
    assert out["dropped"] == [f"harbour.txt@{v.doc_version}/b0.083"] and out["held"] >= 1
    assert list(root.glob("catalog.damaged-*"))
    assert _listing(root) == {"harbour.txt": sorted(set(LABELS_MADE) - {"b0.083"})}
    proc = run_cli("gc", "--grace", "0", store=root)
    trusted = trusted - {lost}
    GC_CASES.append(("forced rebuild that drops a version", len(trusted - _objects(root))))
    assert proc.returncode == 0 and trusted <= _objects(root) and stray in _objects(root)  # held
    assert json.loads(run_cli("gc", "--grace", "0", "--release-held", "--json", store=root).stdout)["objects_removed"] >= 1
    assert stray not in _objects(root) and trusted <= _objects(root)


def test_gc_racing_a_load_ends_in_the_retry_message(default_store, tmp_path, lm, monkeypatch):
    from kdnctl.engine import placed
    from kdnctl.engine.hf import load_version
    from kdnctl.ingest import IngestOptions, ingest_documents
    from kdnctl.ingest.corpus import Document

    root = _copy(default_store, tmp_path)
    with Store(root, create=False) as st:
        old = st.get_version("harbour.txt", "full")
        text = DOC.replace("4417", "5528")
        import hashlib

        doc = Document(doc_id="harbour.txt", text=text, source="harbour.txt",
                       content_sha256=hashlib.sha256(text.encode()).hexdigest())
        ingest_documents(st, lm, [doc], IngestOptions())  # a new version replaces the one a reader picked
        real = placed.read_placed

        def gc_between_plan_and_read(p, *args, **kw):  # the race, at its narrowest point
            st.gc(grace_s=0)
            return real(p, *args, **kw)

        monkeypatch.setattr(placed, "read_placed", gc_between_plan_and_read)
        with pytest.raises(NotFoundError, match="changed while it was being loaded") as exc:
            load_version(lm, st, old)
        assert exc.value.hint == "retry the load"
        monkeypatch.undo()
        with pytest.raises(NotFoundError, match="changed while it was being loaded"):
            load_version(lm, st, old)  # gc done before the load started
    assert json.loads(run_cli("verify", "--json", store=root).stdout)["ok"]


def test_rebuild_recovers_a_document_split_into_segments(tmp_path, tiny_lm):
    """A document longer than the model's context is stored as segments (``doc#1``, ``doc#2``)
    whose texts are not the document's: their bundles name the text, so they rebuild too."""
    from kdnctl.ingest.corpus import Document
    from kdnctl.ingest import IngestOptions, ingest_documents
    from kdnctl.ingest.rebuild import rebuild_catalog

    import hashlib

    text = " ".join(f"Entry {i}: {DOC}" for i in range(30))
    doc = Document(doc_id="long.txt", text=text, source="long.txt", content_sha256=hashlib.sha256(text.encode()).hexdigest())
    root = tmp_path / "kdn"
    with Store(root) as st:
        ingest_documents(st, tiny_lm, [doc], IngestOptions(stats=False))
        want = {d.doc_id: (d.doc_version, d.text_object, d.content_sha256) for d in st.list_documents()}
        trusted = _referenced(root)
    assert len(want) >= 2 and all(d.startswith("long.txt#") for d in want)
    (root / "catalog" / "data.mdb").write_bytes(b"")
    report = rebuild_catalog(root, tiny_lm)
    assert report.skipped == [] and sorted(report.documents) == sorted(want)
    with Store(root, create=False) as st:
        assert {d.doc_id: (d.doc_version, d.text_object, d.content_sha256) for d in st.list_documents()} == want
        assert st.verify() == []
    assert _referenced(root) == trusted
    with Store(root, create=False) as st:  # a segment's record pointed at another segment's text
        first, second = (st.get_document(d) for d in sorted(want)[:2])
        first.text_object = second.text_object
        with st._env.begin(write=True) as txn:
            txn.put(cat.key(first.doc_id, first.doc_version), seal_record(first), db=st._db["docs"])
        problems = st.verify()
        assert len(problems) == 1 and "its bundles name" in problems[0], problems
        with pytest.raises(StoreCorruptError, match="nothing was deleted"):
            st.gc(grace_s=0)
