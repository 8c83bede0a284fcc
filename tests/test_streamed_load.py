"""A remote load of an ec version that keeps every token decodes its chunks as they arrive
(kdnctl/engine/streamed.py): the same K/V, bit for bit, as a load of the same version from the
local store; any other version (evicted tokens, full K/V), and a version given up half-way, is
placed the usual way from the chunks already fetched; a damaged object ends the load with the
store's error and no decode left running. Real model, real store, a real server on loopback."""

from __future__ import annotations

import shutil
import threading

import pytest
import torch
from conftest import EXAMPLES, damage_object
from httpkit import ThreadServer

from kdnctl.compress.document import CompressRecipe, compress_document
from kdnctl.engine import streamed
from kdnctl.engine.hf import CACHE_ROOM, load_document
from kdnctl.errors import StoreCorruptError
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.ingest.corpus import read_corpus
from kdnctl.store import Store
from kdnctl.store.client import RemoteStore

pytestmark = pytest.mark.model
DOC = "faq.md"


@pytest.fixture(scope="module")
def store_root(tmp_path_factory, lm):
    """faq.md in 64-token chunks: ``full``, the 0.25 default (every token kept) and the 0.083
    default (half of them evicted)."""
    docs_dir = tmp_path_factory.mktemp("streamed-docs")
    ids = lm.tokenizer((EXAMPLES / DOC).read_text(), add_special_tokens=False).input_ids[:300]
    (docs_dir / DOC).write_text(lm.tokenizer.decode(ids))
    docs, _ = read_corpus([docs_dir])
    root = tmp_path_factory.mktemp("streamed-store")
    with Store(root) as st:
        ingest_documents(st, lm, docs, IngestOptions(chunk_tokens=64))
        with st.writer():
            for budget in (0.25, 0.083):
                compress_document(st, DOC, CompressRecipe(budget=budget), lm=lm)
    return root


@pytest.fixture(scope="module")
def url(store_root):
    srv = ThreadServer(store_root)
    yield srv.url
    srv.stop()


def _local(lm, root, label):
    with Store(root, create=False) as st:
        ctx = load_document(lm, st, DOC, label)
        ctx.settle()
        return ctx


def _same(a, b) -> None:
    assert a.token_ids == b.token_ids and a.next_position == b.next_position
    assert len(a.keys) == len(b.keys)
    for ka, kb, va, vb in zip(a.keys, b.keys, a.values, b.values):
        assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.mark.parametrize("overlap", [True, False])
def test_streamed_decode_equals_a_local_load(lm, store_root, url, overlap, monkeypatch):
    want = _local(lm, store_root, "b0.25")
    real, made = streamed.load_streamed, []
    monkeypatch.setattr(streamed, "load_streamed", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    with RemoteStore(url) as remote:
        version = remote.get_version(DOC, "b0.25")
        got = real(lm, remote, [(version, c) for c in version.chunks], label="b0.25", doc_id=DOC, workers=4,
                   overlap=overlap, room=CACHE_ROOM)
        assert got.ctx is not None and len(got.bundles) == len(version.chunks) >= 4
        assert got.nbytes == sum(c.nbytes for c in version.chunks)
        got.ctx.settle()
        _same(got.ctx, want)
        ctx = load_document(lm, remote, DOC, "b0.25", overlap=overlap)  # the loader takes that path
        assert len(made) == 1 and made[0].ctx is ctx
        ctx.settle()
        _same(ctx, want)


@pytest.mark.parametrize("label", ["b0.083", "full"])
def test_other_versions_are_placed_from_the_chunks_fetched(lm, store_root, url, label):
    want = _local(lm, store_root, label)
    with RemoteStore(url) as remote:
        version = remote.get_version(DOC, label)
        got = streamed.load_streamed(lm, remote, [(version, c) for c in version.chunks], label=label, doc_id=DOC,
                                     workers=4, overlap=True, room=CACHE_ROOM)
        assert got.ctx is None and all(b is not None for b in got.bundles)
        requests = remote.stats["requests"]
        ctx = load_document(lm, remote, DOC, label, overlap=True)
        ctx.settle()
        _same(ctx, want)
        assert remote.stats["requests"] - requests == 1 + len(version.chunks)  # the listing, each chunk once


def test_a_decode_given_up_half_way_is_placed_the_usual_way(lm, store_root, url, monkeypatch):
    """The third chunk to arrive does not fit (as a chunk with evicted tokens would not): the
    decode already running stops, and the load places every chunk as a fetched-first load does."""
    want = _local(lm, store_root, "b0.25")
    real, calls = streamed._fits, []

    def third_refused(*args):
        calls.append(1)
        return len(calls) != 3 and real(*args)

    monkeypatch.setattr(streamed, "_fits", third_refused)
    with RemoteStore(url) as remote:
        version = remote.get_version(DOC, "b0.25")
        got = streamed.load_streamed(lm, remote, [(version, c) for c in version.chunks], label="b0.25", doc_id=DOC,
                                     workers=1, overlap=True, room=CACHE_ROOM)
        assert got.ctx is None and len(calls) == 3
        ctx = load_document(lm, remote, DOC, "b0.25", overlap=True)
        ctx.settle()
        _same(ctx, want)
    assert not [t for t in threading.enumerate() if t.name == "kdnctl-decode"]


def test_a_damaged_object_ends_the_load_with_no_decode_left(lm, store_root, tmp_path):
    root = tmp_path / "store"
    shutil.copytree(store_root, root)
    with Store(root, create=False) as st:
        version = st.get_version(DOC, "b0.25")
    sha = version.chunks[-1].object  # the last: earlier chunks are being decoded when it fails
    damage_object(root, sha)
    srv = ThreadServer(root)
    try:
        with RemoteStore(srv.url, retries=0) as remote:
            with pytest.raises(StoreCorruptError):
                load_document(lm, remote, DOC, "b0.25", overlap=True, workers=1)
    finally:
        srv.stop()
    assert not [t for t in threading.enumerate() if t.name == "kdnctl-decode"]
