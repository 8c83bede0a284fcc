"""Size-budgeted compression end to end with the real model: the byte cap (everything included)
for several budgets and documents, the tier mix recorded in the bundles, and a mixed-tier
bundle loading locally and through a real loopback serve-files with the same logits as
dequantizing it by hand (an independent decoder written here from docs/bundle-format.md)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from budgetkit import DOCS, assert_loads_as_decoded, fp16_size, rope_by_hand, trimmed_store

from kdnctl.format.bundle import decode_bundle, read_meta
from kdnctl.compress.document import CompressRecipe, compress_document
from kdnctl.kernels.quant import reference as ref

pytestmark = pytest.mark.model
TIERS = ("fp16", "int8", "int4", "int3", "int2")


@pytest.fixture(scope="module")
def store(tmp_path_factory, lm):
    st = trimmed_store(tmp_path_factory, lm, DOCS)
    with st.writer():
        for doc in DOCS:
            for b in (0.25, 0.15, 0.083):
                compress_document(st, doc, CompressRecipe(budget=b, quant="ladder", scorer="surprisal"))
            for b in (0.25, 0.083):
                compress_document(st, doc, CompressRecipe(budget=b, quant="floor", scorer="surprisal"))
            for b in (0.083, 0.15):  # int4 + sentence eviction (an earlier default below 0.25)
                compress_document(st, doc, CompressRecipe(budget=b, quant="int4", scorer="sentences", protect=64,
                                                          method_options={"ratio": 0.0}), lm=lm)
    yield st
    st.close()


def _stored_and_cap(st, doc, label, budget):
    """The version, its stored bytes (whole objects: headers too) and its byte cap."""
    v = st.get_version(doc, label)
    return v, sum(len(st.read_object(c.object)) for c in v.chunks), budget * fp16_size(st, doc)


@pytest.mark.parametrize("budget", [0.25, 0.15, 0.083])
@pytest.mark.parametrize("doc", list(DOCS))
def test_byte_cap_includes_everything(store, doc, budget):
    v, stored, cap = _stored_and_cap(store, doc, f"ladder-b{budget:g}-surprisal", budget)
    assert stored == v.nbytes
    assert stored <= cap
    assert stored >= 0.9 * cap  # the ladder fills the budget rather than leaving it unused
    metas = [read_meta(store.read_object(c.object)) for c in v.chunks]
    mix = metas[0]["quant"]["mix"]
    assert metas[0]["quant"]["scheme"] == "ladder" and set(mix) == {"keys", "values"}
    assert metas[0]["quant"]["coding"] == "zlib+params"
    assert set(mix["keys"]) <= set(TIERS)


@pytest.mark.parametrize("budget", [0.25, 0.083])
@pytest.mark.parametrize("doc", list(DOCS))
def test_floor_fills_the_cap_with_upgrades_not_evictions(store, doc, budget):
    """``--quant floor``: every row at least at the best uniform tier, the bytes left lift rows
    one tier; an overflow of the first plan takes upgrades back, then lowers the floor one tier,
    never evicts unless even the lowest tier does not fit (0.083: int2 plus forced eviction)."""
    v, stored, cap = _stored_and_cap(store, doc, f"floor-b{budget:g}-surprisal", budget)
    assert 0.9 * cap <= stored <= cap
    bundles = [decode_bundle(store.read_object(c.object)) for c in v.chunks]
    mix = bundles[0].meta["quant"]["mix"]
    if budget == 0.25:
        assert all(b.layer_len(i) == b.n_tokens for b in bundles for i in range(b.n_layers))
        # these short documents (220-300 tokens, 128-token chunks) spend ~2.5% of the cap on
        # headers, so int3 everywhere does not fit once encoded: the floor drops some rows to
        # int2 rather than evicting (int3 rows stay the majority)
        assert set(mix["keys"]) | set(mix["values"]) <= {"int2", "int3", "int4"}
        assert mix["keys"].get("int3", 0) > sum(mix["keys"].values()) / 2
    else:
        assert sum(b.kept_tokens for b in bundles) < sum(b.n_tokens for b in bundles)
        assert set(mix["keys"]) | set(mix["values"]) <= {"int2", "int3"}


@pytest.mark.parametrize("budget", [0.083, 0.15])
@pytest.mark.parametrize("doc", list(DOCS))
def test_int4_below_int3_keeps_whole_sentences(store, lm, doc, budget):
    """``--budget 0.083 --quant int4 --scorer sentences --kvcrush-ratio 0 --protect 64``: every kept row int4, the cap evicts the rest by sentence, the
    prompt header and then the last 64 tokens always kept (as far as the quota reaches: these
    short documents keep only ~75 tokens at 0.083); the cap holds with everything included."""
    from kdnctl.scorers.sentences import sentence_bounds, token_texts

    v, stored, cap = _stored_and_cap(store, doc, f"int4-b{budget:g}-p64-sentences", budget)
    assert 0.85 * cap <= stored <= cap
    bundles = [decode_bundle(store.read_object(c.object)) for c in v.chunks]
    mix = bundles[0].meta["quant"]["mix"]
    assert set(mix["keys"]) == {"int4"} and set(mix["values"]) == {"int4"}
    n = sum(b.n_tokens for b in bundles)
    header = int(bundles[0].meta.get("header_tokens", 0))
    ids = [int(t) for b in bundles for t in b.token_ids.tolist()]
    for i in range(bundles[0].n_layers):
        pos = torch.cat([b.tensors[f"layers.{i}.positions"].long() for b in bundles], dim=1)  # [H, kept]
        assert pos.shape[1] < n  # the cap forced eviction
        assert all(torch.equal(pos[0], pos[h]) for h in range(pos.shape[0]))  # one score for every head
        kept = set(pos[0].tolist())
        tail = min(64, len(kept) - header)
        assert set(range(header)) <= kept and set(range(n - tail, n)) <= kept
    # whole sentences: at most one sentence (where the quota ran out) is kept in part
    partial = [1 for a, b in sentence_bounds(token_texts(lm.tokenizer, ids)) if 0 < len(kept & set(range(a, b))) < b - a
               and not (a < header or b > n - tail)]
    assert len(partial) <= 1
    if budget == 0.15:  # room beyond the header and the tail: whole sentences fill it
        assert len(kept) > header + 64 + 10


def test_eviction_only_when_forced(store):
    """At 0.25 every token is kept (precision pays); at 0.083 the cap forces eviction, and then
    every kept row is at the lowest tier or near it."""
    for doc in DOCS:
        b = decode_bundle(store.read_object(store.get_version(doc, "ladder-b0.25-surprisal").chunks[0].object))
        assert "positions" in b.tensors and all(b.layer_len(i) == b.n_tokens for i in range(b.n_layers))
        b = decode_bundle(store.read_object(store.get_version(doc, "ladder-b0.083-surprisal").chunks[0].object))
        assert b.kept_tokens < b.n_tokens
        mix = b.meta["quant"]["mix"]
        assert set(mix["keys"]) <= {"int2", "int3"}


def _hadamard(d):
    h = torch.tensor([[1.0]])
    while h.shape[0] < d:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), h)
    return h / math.sqrt(d)


def _by_hand(b, i, role):
    """Decode one laddered layer/role from the format description alone."""
    q = b.meta["quant"]
    d, g = q["head_dim"], q["group_size"]
    layout = "channel" if role == "keys" else "token"
    tiers = b.tensors[f"layers.{i}.tiers"].long()
    ids = tiers % 16 if role == "keys" else tiers // 16
    codes = b.tensors[f"layers.{i}.{role}.codes"]
    if q.get("coding") in ("zlib", "zlib+params"):
        codes = torch.frombuffer(bytearray(zlib.decompress(codes.numpy().tobytes())), dtype=torch.uint8)
    params = b.tensors[f"layers.{i}.{role}.params"]
    if q.get("coding") == "zlib+params":  # scales then zeros, fp16, zlib-coded as raw bytes
        params = torch.frombuffer(bytearray(zlib.decompress(params.numpy().tobytes())), dtype=torch.float16)
    out = torch.zeros(*ids.shape, d)
    co = po = 0
    for t, name in enumerate(TIERS):
        mask = ids == t
        n = int(mask.sum())
        if not n:
            continue
        if name == "fp16":
            rows = codes[co:co + 2 * n * d].clone().view(torch.float16).float().view(n, d)
            co += 2 * n * d
        else:
            bits = int(name[3:])
            per_row_bytes = math.ceil(n * bits / 8) if layout == "channel" else None
            qs, ss = ref.out_shapes((1, n, d), name, g, layout)
            nq, ns = math.prod(qs), math.prod(ss)
            if per_row_bytes is not None and bits != 3:
                assert nq == per_row_bytes * d  # packed along the token axis for keys
            rows = ref.dequantize(codes[co:co + nq].view(qs), params[po:po + ns].view(ss),
                                  params[po + ns:po + 2 * ns].view(ss), name, g, layout, (1, n, d))[0]
            co, po = co + nq, po + 2 * ns
        out[mask] = rows
    assert co == codes.numel() and po == params.numel()
    if role == "values":
        return out @ _hadamard(d)
    return rope_by_hand(out, b.layer_positions(i), q["key_rope_theta"])


@pytest.mark.parametrize("label", ["ladder-b0.25-surprisal", "ladder-b0.083-surprisal"])
def test_mixed_tier_bundle_loads_locally_and_remotely(lm, store, label):
    assert_loads_as_decoded(lm, store, "faq.md", label, _by_hand)
