"""``--key-weight W`` with ``--quant ec``: a key error counts W times a value error, so at the same
byte cap the keys' steps shrink by ``1/sqrt(W)`` against the values' (at 0.083 the multi-fact
answers lost to quantization come back with exact keys, not exact values:
``bench/precision_probe.py``). Also ``--lift-level`` above the header's level."""

from __future__ import annotations

import torch


def _errors(st, doc, label):
    from kdnctl.bundle import decode_bundle

    def dense(lab):
        bs = [decode_bundle(st.read_object(c.object)) for c in st.get_version(doc, lab).chunks]
        pos = torch.cat([b.layer_positions(0)[0] for b in bs]).long()
        kv = [[b.layer_kv(i) for b in bs] for i in range(bs[0].n_layers)]
        return pos, [(torch.cat([k for k, _ in x], 1).float(), torch.cat([v for _, v in x], 1).float()) for x in kv]

    full_pos, full = dense("full")
    pos, got = dense(label)
    at = torch.searchsorted(full_pos, pos)
    ke = sum(float((k - fk[:, at]).pow(2).sum()) for (k, _), (fk, _) in zip(got, full))
    ve = sum(float((v - fv[:, at]).pow(2).sum()) for (_, v), (_, fv) in zip(got, full))
    return ke, ve, pos


def test_key_weight_moves_precision_from_values_to_keys(tiny_lm, tmp_path_factory):
    from budgetkit import fp16_size, trimmed_store

    from kdnctl.compress import CompressRecipe, compress_document

    st = trimmed_store(tmp_path_factory, tiny_lm, {"meeting-notes-2026-03.txt": 300})
    doc = "meeting-notes-2026-03.txt"
    base = dict(budget=0.6, quant="ec", keep=0.5, protect=16, scorer="sentences")
    with st.writer():
        plain = compress_document(st, doc, CompressRecipe(**base), lm=tiny_lm)
        keyed = compress_document(st, doc, CompressRecipe(**base, key_weight=16), lm=tiny_lm)
    cap = 0.6 * fp16_size(st, doc)
    assert keyed.label.endswith("-kw16-sentences") and plain.bytes <= cap and keyed.bytes <= cap
    k1, v1, pos1 = _errors(st, doc, plain.label)
    k16, v16, pos16 = _errors(st, doc, keyed.label)
    assert torch.equal(pos1, pos16)  # the same kept tokens: only the steps move
    assert k16 < 0.5 * k1 and v16 > 2 * v1, (k1, k16, v1, v16)


def test_lift_level_above_the_headers(tiny_lm, tmp_path_factory):
    from budgetkit import fp16_size, trimmed_store

    from kdnctl.bundle import decode_bundle
    from kdnctl.compress import CompressRecipe, compress_document

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
