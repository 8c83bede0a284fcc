"""``--key-weight W`` with ``--quant ec``: a key error counts W times a value error, so at the same
byte cap the keys' steps shrink by ``1/sqrt(W)`` against the values' (at 0.083 the multi-fact
answers lost to quantization come back with exact keys, not exact values:
``bench/precision_probe.py``). Also ``--lift-level`` above the header's level."""

from __future__ import annotations

import torch
from kdnctl.quant import layer_kv


def _errors(st, doc, label):
    from kdnctl.format.bundle import decode_bundle

    def dense(lab):
        bs = [decode_bundle(st.read_object(c.object)) for c in st.get_version(doc, lab).chunks]
        pos = torch.cat([b.layer_positions(0)[0] for b in bs]).long()
        kv = [[layer_kv(b, i) for b in bs] for i in range(bs[0].n_layers)]
        return pos, [(torch.cat([k for k, _ in x], 1).float(), torch.cat([v for _, v in x], 1).float()) for x in kv]

    full_pos, full = dense("full")
    pos, got = dense(label)
    at = torch.searchsorted(full_pos, pos)
    ke = sum(float((k - fk[:, at]).pow(2).sum()) for (k, _), (fk, _) in zip(got, full))
    ve = sum(float((v - fv[:, at]).pow(2).sum()) for (_, v), (_, fv) in zip(got, full))
    return ke, ve, pos


def test_key_weight_moves_precision_from_values_to_keys(tiny_lm, tmp_path_factory):
    from budgetkit import fp16_size, trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document

    st = trimmed_store(tmp_path_factory, tiny_lm, {"meeting-notes-2026-03.txt": 300})
    doc = "meeting-notes-2026-03.txt"
    # (the cap binds: at 0.6 the tiny model's finest steps fit; even layers: the key weight's move
    # alone, not the Fisher split's per-layer multipliers beside it)
    base = dict(budget=0.3, quant="ec", keep=0.5, protect=16, scorer="sentences", layers="even")
    with st.writer():
        plain = compress_document(st, doc, CompressRecipe(**base), lm=tiny_lm)
        keyed = compress_document(st, doc, CompressRecipe(**base, key_weight=16), lm=tiny_lm)
    cap = 0.3 * fp16_size(st, doc)
    assert keyed.label.endswith("-kw16-even-sentences") and plain.bytes <= cap and keyed.bytes <= cap
    k1, v1, pos1 = _errors(st, doc, plain.label)
    k16, v16, pos16 = _errors(st, doc, keyed.label)
    assert torch.equal(pos1, pos16)  # the same kept tokens: only the steps move
    assert k16 < 0.5 * k1 and v16 > 2 * v1, (k1, k16, v1, v16)


def test_lift_level_above_the_headers(tiny_lm, tmp_path_factory):
    from budgetkit import fp16_size, trimmed_store

    from kdnctl.format.bundle import decode_bundle
    from kdnctl.compress.document import CompressRecipe, compress_document

    st = trimmed_store(tmp_path_factory, tiny_lm, {"meeting-notes-2026-03.txt": 300})
    doc = "meeting-notes-2026-03.txt"
    r = CompressRecipe(budget=0.3, quant="ec", keep=0.5, protect=16, scorer="sentences", lift="literals",
                       lift_share=0.05, lift_level=4)
    with st.writer():
        out = compress_document(st, doc, r, lm=tiny_lm)
    assert out.bytes <= 0.3 * fp16_size(st, doc)
    bs = [decode_bundle(st.read_object(c.object)) for c in st.get_version(doc, out.label).chunks]
    levels = torch.cat([b.tensors["token_levels"] for b in bs])
    kept = torch.cat([b.layer_positions(0)[0] for b in bs]).long()
    ids = [int(t) for b in bs for t in b.token_ids.tolist()]
    lifted = [tiny_lm.tokenizer.decode([ids[int(kept[j])]]) for j in torch.nonzero(levels == 4).flatten()]
    # the top 5% by literals, less those the header and the forced tail already hold at level 2
    assert 0 < len(lifted) <= int(0.05 * levels.numel()) and all(any(c.isdigit() for c in t) for t in lifted), lifted
    assert int((levels == 2).sum()) >= 16 and set(levels.tolist()) <= {0, 2, 4}


def _version(st, doc, label):
    from kdnctl.format.bundle import decode_bundle

    return [decode_bundle(st.read_object(c.object)) for c in st.get_version(doc, label).chunks]


def test_lift_role_keys_lifts_the_keys_alone(tiny_lm, tmp_path_factory):
    """``--lift-role keys`` (1.10): the chunk's ``token_levels.keys`` carries the lift, its
    ``token_levels`` (the values') does not; the reader takes each role's own; within the cap; with
    ``--backfill`` too (the backfilled layer's per-role levels hold the lift on its kept tokens)."""
    from budgetkit import fp16_size, trimmed_store

    from kdnctl.format.bundle import KVBundle
    from kdnctl.compress.document import CompressRecipe, compress_document

    st = trimmed_store(tmp_path_factory, tiny_lm, {"meeting-notes-2026-03.txt": 300})
    doc = "meeting-notes-2026-03.txt"
    base = dict(budget=0.3, quant="ec", keep=0.5, protect=16, scorer="sentences", lift="literals", lift_share=0.1,
                lift_level=4)
    with st.writer():
        keyed = compress_document(st, doc, CompressRecipe(**base, lift_role="keys"), lm=tiny_lm)
        both = compress_document(st, doc, CompressRecipe(**base), lm=tiny_lm)
        filled = compress_document(st, doc, CompressRecipe(**base, lift_role="keys", backfill="1", backfill_shift=2),
                                   lm=tiny_lm)
    cap = 0.3 * fp16_size(st, doc)
    assert keyed.label.endswith("-lliterals0.1x4k-sentences") and max(keyed.bytes, both.bytes, filled.bytes) <= cap
    ks, bs = _version(st, doc, keyed.label), _version(st, doc, both.label)
    key_lv = torch.cat([b.tensors["token_levels.keys"] for b in ks])
    val_lv = torch.cat([b.tensors["token_levels"] for b in ks])
    assert torch.equal(key_lv, torch.cat([b.tensors["token_levels"] for b in bs]))  # the same lift, on the keys
    assert int((key_lv == 4).sum()) > 0 and set(val_lv.tolist()) <= {0, 2} and torch.equal(val_lv.clamp_max(2), val_lv)
    assert torch.equal(val_lv[key_lv != 4], key_lv[key_lv != 4])
    # the reader takes the keys' own levels: without them the same codes decode to other keys
    b = ks[0]
    plain = KVBundle(meta=b.meta, tensors={n: t for n, t in b.tensors.items() if n != "token_levels.keys"})
    lifted = b.tensors["token_levels.keys"] == 4
    if bool(lifted.any()):
        assert not torch.equal(layer_kv(plain, 0)[0][:, lifted], layer_kv(b, 0)[0][:, lifted])
        assert torch.equal(layer_kv(plain, 0)[1], layer_kv(b, 0)[1])
    fs = _version(st, doc, filled.label)
    kept_k = torch.cat([b.tensors["token_levels.keys"] for b in fs])
    assert torch.equal(kept_k, key_lv)  # the pruned layer: the chunk's two rows
    for f in fs:  # the backfilled layer: every token, the kept ones shifted by 2 in both roles
        k_lv, v_lv, kept = f.tensors["layers.1.keys.levels"], f.tensors["layers.1.values.levels"], f.tensors["kept"].bool()
        assert torch.equal(k_lv[kept], f.tensors["token_levels.keys"] + 2)
        assert torch.equal(v_lv[kept], f.tensors["token_levels"] + 2) and int(k_lv[~kept].sum()) == 0
        assert "layers.0.levels" not in f.tensors and "layers.1.levels" not in f.tensors


def test_lift_role_refusals():
    import pytest

    from kdnctl.compress.document import CompressRecipe
    from kdnctl.errors import UsageError

    r = CompressRecipe(budget=0.083, lift="literals", lift_share=0.08, lift_level=4, lift_role="keys")
    assert r.as_dict()["lift_role"] == "keys" and r.default_label().endswith("-lliterals0.08x4k-rf0.01hdf-sentences-gap")
    for bad, match in [(dict(lift="literals", lift_role="values"), "lift_role"), (dict(lift_role="keys", lift="none"), "set how ec lifts")]:
        with pytest.raises(UsageError, match=match):
            CompressRecipe(budget=0.083, **bad)
