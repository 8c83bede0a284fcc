"""Local loads read dense chunks straight into the cache and check every byte with the XXH3-128
checksum recorded at write time (kdnctl/engine/placed.py, kdnctl/store/fastread.py; issue 15).
Real SmolLM2 and real stores; nothing is timed (bench/ttft.py measures)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from kdnctl.format.bundle import decode_bundle
from kdnctl.compress.document import CompressRecipe, compress_document
from kdnctl.ingest.corpus import Document
from kdnctl.engine import hf
from kdnctl.engine import placed
from kdnctl.engine.hf import forward_suffix, load_document
from kdnctl.errors import StoreCorruptError
from kdnctl.store.fastread import Verifier, blake3_hex, xxh3_hex
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.ingest.prompting import PromptFormat
from kdnctl.store import Store
from kdnctl.store.records import ChunkRef

from conftest import EXAMPLES
from kdnctl.quant import layer_kv

DOC = "zephyr-x200-manual.md"


@pytest.fixture(scope="module")
def stores(lm, tmp_path_factory):
    """~200 tokens ingested in fp32 (the model's dtype) and fp16, plus b1-int8 and a dense
    pruned version (keep 0.5: layers hold different token counts) of the fp32 one."""
    text = (EXAMPLES / DOC).read_text()
    body = lm.tokenizer.decode(lm.tokenizer(text, add_special_tokens=False).input_ids[:200])
    doc = Document(DOC, body, "test", hashlib.sha256(body.encode()).hexdigest())
    out = {}
    for kv in (None, "float16"):
        st = Store(tmp_path_factory.mktemp(f"placed-{kv}"))
        ingest_documents(st, lm, [doc], IngestOptions(chunk_tokens=64, kv_dtype=kv))
        out[kv] = st
    with out[None].writer():
        compress_document(out[None], DOC, CompressRecipe(budget=None, keep=1.0, quant="int8"), label="b1-int8")
        compress_document(out[None], DOC, CompressRecipe(budget=None, keep=0.5, scorer="window"), label="k50")
    yield out
    for st in out.values():
        st.close()


def _hits(store, label="full"):
    v = store.get_version(DOC, label)
    return [(v, c) for c in v.chunks]


def _reference(store, label):
    """Per layer K/V the obvious way: whole objects read and checked by their sha256 name,
    decoded and concatenated."""
    bundles = [decode_bundle(store.read_object(c.object)) for c in store.get_version(DOC, label).chunks]
    n = bundles[0].n_layers
    return [tuple(torch.cat([layer_kv(b, i)[r] for b in bundles], dim=1) for r in (0, 1)) for i in range(n)]


def _question(lm):
    return PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, "How long does charging take?")


def test_xxh3_is_recorded_at_write_time(stores):
    store = stores[None]
    for label in ("full", "b1-int8", "k50"):
        for c in store.get_version(DOC, label).chunks:
            data = store.read_object(c.object)
            assert c.xxh3 == xxh3_hex(data) and len(c.xxh3) == 32
            assert c.blake3 == blake3_hex(data)  # the remote client's cryptographic check stays


@pytest.mark.parametrize("label", ["full", "k50"])
def test_dense_chunks_are_placed_directly_and_equal_the_reference(lm, stores, label):
    store = stores[None]
    direct = hf._load_placed(lm, store, _hits(store, label), None)
    assert direct is not None
    ctx = load_document(lm, store, DOC, label)
    ref = _reference(store, label)
    for i, (k, v) in enumerate(ref):
        assert torch.equal(ctx.keys[i][0], k) and torch.equal(ctx.values[i][0], v)
    # the K/V bytes went straight into the cache: the bundles hold only stand-ins for them
    bundles, bufs, _ = direct
    assert bundles[1].tensors["layers.0.keys"].device.type == "meta"
    assert bundles[1].tensors["token_ids"].tolist() == ctx.token_ids[bundles[0].n_tokens : bundles[0].n_tokens
                                                                     + bundles[1].n_tokens]
    for i, (k, v) in enumerate(ref):
        assert torch.equal(bufs[i][0][0, :, : k.shape[1]], k) and torch.equal(bufs[i][1][0, :, : v.shape[1]], v)


def test_quantized_or_other_dtype_takes_the_general_path(lm, stores):
    assert hf._load_placed(lm, stores[None], _hits(stores[None], "b1-int8"), None) is None
    assert hf._load_placed(lm, stores["float16"], _hits(stores["float16"]), None) is None
    ctx = load_document(lm, stores["float16"], DOC)  # still loads (cast on the general path)
    assert ctx.keys[0].dtype == lm.dtype


def test_logits_after_a_placed_load_equal_full_prefill(lm, stores):
    q = _question(lm)
    ctx = load_document(lm, stores[None], DOC)
    cached, _ = forward_suffix(lm, ctx, q)
    full, _ = forward_suffix(lm, None, ctx.token_ids + q)
    assert (cached[-1] - full[-1]).abs().max().item() <= 1e-4


def _flip(path, at):
    raw = bytearray(path.read_bytes())
    raw[at] ^= 1
    path.chmod(0o644)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("where", ["payload", "last byte", "header"])
def test_one_flipped_byte_fails_the_load(lm, stores, where):
    store = stores[None]
    ref = store.get_version(DOC).chunks[1]
    path = store.object_path(ref.object)
    size = path.stat().st_size
    at = {"payload": size // 2, "last byte": size - 1, "header": 40}[where]
    _flip(path, at)
    try:
        with pytest.raises(StoreCorruptError, match="corrupted"):
            load_document(lm, store, DOC)
        if where != "header":  # a damaged header sends the load down the general path (hash first)
            with pytest.raises(StoreCorruptError, match="XXH3-128"):
                hf._load_placed(lm, store, _hits(store), None)
        with pytest.raises(StoreCorruptError, match="XXH3-128"):
            store.read_object_checked(ref.object, ref.blake3, ref.xxh3)
    finally:
        _flip(path, at)
    load_document(lm, store, DOC)


def test_catalogs_without_fast_digests_still_load_and_check(lm, stores, tmp_path):
    """A version recorded before XXH3 (or BLAKE3) existed: loads identically, checked by the
    next digest down; a flipped byte still fails."""
    store = stores[None]
    want = load_document(lm, store, DOC)
    old = Store(store.root, create=False)  # a fresh instance remembers no digests of its own
    v = old.get_version(DOC)
    try:
        for strip, kind in ((("xxh3",), "BLAKE3"), (("xxh3", "blake3"), "hash")):
            chunks = [dataclasses.replace(c, **{k: None for k in strip}) for c in v.chunks]
            with old.writer():
                old.commit_version(dataclasses.replace(v, chunks=chunks))
            got = old.get_version(DOC)
            assert all(getattr(c, k) is None for c in got.chunks for k in strip)
            ctx = load_document(lm, old, DOC)
            assert all(torch.equal(a, b) for a, b in zip(ctx.keys, want.keys))
            path = old.object_path(got.chunks[0].object)
            _flip(path, path.stat().st_size // 2)
            try:
                with pytest.raises(StoreCorruptError, match=kind):
                    load_document(lm, old, DOC)
            finally:
                _flip(path, path.stat().st_size // 2)
    finally:
        with old.writer():
            old.commit_version(v)  # the digests back, for the other tests
        old.close()
    assert all(c.xxh3 for c in store.get_version(DOC).chunks)


def test_an_object_that_shrinks_after_planning_is_refused(lm, stores):
    store = stores[None]
    hit = _hits(store)[0]
    path = store.object_path(hit[1].object)
    s = lm.summary
    p = placed.plan(path, hit, dtype=lm.dtype, n_layers=s["n_layers"], h_kv=s["n_kv_heads"], head_dim=s["head_dim"])
    raw = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(raw[: len(raw) - 1000])
    try:
        bufs = hf._alloc(lm, p.lens, s["n_kv_heads"], s["head_dim"], 0)
        with pytest.raises(StoreCorruptError, match="shrank"):
            placed.read_placed(p, bufs, placed.byte_views(bufs), [0] * len(p.lens),
                               expect_fingerprint=lm.fingerprint)
    finally:
        path.write_bytes(raw)


def test_verifier_picks_the_check_and_remote_never_uses_xxh3():
    data = bytes(range(256)) * 100
    sha = hashlib.sha256(data).hexdigest()
    assert Verifier(sha, blake3_hex(data), xxh3_hex(data)).kind == "XXH3-128 checksum"
    assert Verifier(sha, blake3_hex(data), xxh3_hex(data), local=False).kind == "BLAKE3"
    assert Verifier(sha).kind == "hash"
    for v in (Verifier(sha, blake3_hex(data), xxh3_hex(data)), Verifier(sha, None, None)):
        v.update(data[:1000])
        v.update(data[1000:])
        v.finish()
    bad = Verifier(sha, None, xxh3_hex(data[:-1] + b"x"))
    bad.update(data)
    with pytest.raises(StoreCorruptError, match="XXH3-128"):
        bad.finish()


def test_xxh3_field_is_validated_in_records():
    base = {"index": 0, "object": "a" * 64, "token_start": 0, "token_end": 4, "chain_hash": "b" * 64,
            "nbytes": 10, "blake3": None}
    assert ChunkRef.from_dict({**base, "xxh3": "c" * 32}).xxh3 == "c" * 32
    assert ChunkRef.from_dict(base).xxh3 is None  # written before the field existed
    for bad in ("c" * 31, "C" * 32, 7):
        with pytest.raises(StoreCorruptError, match="xxh3"):
            ChunkRef.from_dict({**base, "xxh3": bad})


def test_arena_pool_reuses_memory_only_when_nothing_views_it():
    from kdnctl.store.arena import ArenaPool, kv_buffers

    pool = ArenaPool(max_arenas=2)
    a = kv_buffers([10, 20], 3, 64, 4, torch.float32, pool=pool)
    first = a[0][0].data_ptr()
    assert a[1][1].shape == (1, 3, 24, 64) and first % 64 == 0
    b = kv_buffers([10, 20], 3, 64, 4, torch.float32, pool=pool)  # a is alive: other memory
    assert b[0][0].data_ptr() != first
    kept = a[1][1][0, :, 3]  # one small view keeps the whole arena busy
    del a
    c = kv_buffers([10, 20], 3, 64, 4, torch.float32, pool=pool)
    third = c[0][0].data_ptr()
    assert third != first
    c[0][0].fill_(1.0)
    kept.fill_(7.0)
    assert (c[0][0] == 1.0).all()  # writes through the old view never reach the new buffers
    del kept, c
    d = kv_buffers([10, 20], 3, 64, 4, torch.float32, pool=pool)
    assert d[0][0].data_ptr() in {first, third}  # freed memory comes back
    assert sum(1 for _, free in pool._states() if free) <= 2


def test_fetch_pool_hands_out_exact_sizes_and_never_a_held_buffer():
    from kdnctl.store.arena import ArenaPool

    pool = ArenaPool(max_arenas=4, max_bytes=1 << 20)
    a = pool.take(1000, exact=True)
    assert type(a) is bytearray and len(a) == 1000
    addr = id(a)
    b = pool.take(1000, exact=True)  # a is held: another buffer
    assert b is not a
    view = memoryview(a)
    del a
    assert id(pool.take(1000, exact=True)) != addr  # the view still holds it
    del view
    assert id(pool.take(1000, exact=True)) == addr  # now it comes back
    assert len(pool.take(999, exact=True)) == 999


def test_contexts_never_share_pooled_memory(lm, stores):
    store = stores[None]
    one = load_document(lm, store, DOC)
    two = load_document(lm, store, DOC)
    assert one.keys[0].data_ptr() != two.keys[0].data_ptr()
    ptr = two.keys[0].data_ptr()
    del two
    three = load_document(lm, store, DOC)  # the freed context's memory may come back
    assert three.keys[0].data_ptr() != one.keys[0].data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(one.keys, three.keys))
    assert ptr  # (reuse itself is a speed matter: bench/ttft.py)
