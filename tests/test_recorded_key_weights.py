"""Ingest records each chunk's squared queries (bundle tensor ``query_energy``) from its own
prefill, and compress reads the key weights from them instead of running a forward over the
document: the same weights as that forward (``kdnctl.quant.sensitivity.key_weights``) on every
architecture, with the prefill in several blocks whose bounds cut through chunks."""

from __future__ import annotations

import hashlib

import pytest
import torch

from conftest import EXAMPLES
from test_models import DOC, build_model_dir

from kdnctl.compress.document import CompressRecipe, compress_document
from kdnctl.errors import BundleFormatError
from kdnctl.format.bundle import QUERY_ENERGY, KVBundle, decode_bundle, encode_bundle
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.ingest.corpus import Document
from kdnctl.models import adapter_for
from kdnctl.quant import sensitivity
from kdnctl.quant.sensitivity import key_weights, recorded_key_weights
from kdnctl.store import Store

RTOL = 1e-5  # the sums run over the same queries in another order


def _ingest(root, mlm, text: str, **opts) -> tuple[Store, list[KVBundle]]:
    st = Store(root)
    doc = Document("doc.md", text, "test", hashlib.sha256(text.encode()).hexdigest())
    ingest_documents(st, mlm, [doc], IngestOptions(**opts))
    return st, [decode_bundle(st.read_object(c.object)) for c in st.get_version("doc.md", "full").chunks]


def _forward_weights(mlm, bundles) -> torch.Tensor:
    a = adapter_for(mlm.model)
    ids = [int(t) for b in bundles for t in b.tensors["token_ids"].tolist()]
    sensitivity.forget_key_weights()
    return key_weights(mlm, ids, a.n_layers, a.n_kv_heads, a.head_dim)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gpt-neox", "olmo2", "gemma2"])
def test_recorded_key_weights_equal_the_forwards(arch, lm, tmp_path):
    from kdnctl.models.load import load_model

    mlm = load_model(build_model_dir(arch, tmp_path / "model", lm.tokenizer))
    # 128-token chunks, blocks of 200 queries: the second block starts inside the second chunk
    _, bundles = _ingest(tmp_path / "store", mlm, DOC.read_text(), chunk_tokens=128, block_tokens=200)
    a = adapter_for(mlm.model)
    assert len(bundles) > 3
    for b in bundles:
        e = b.tensors[QUERY_ENERGY]
        assert e.dtype == torch.float32 and list(e.shape) == [a.n_layers, a.n_kv_heads, a.head_dim]
    got = recorded_key_weights(mlm, bundles, sum(b.n_tokens for b in bundles))
    want = _forward_weights(mlm, bundles)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0.0)


def test_compress_reads_them_instead_of_a_forward(tiny_lm, tmp_path, monkeypatch):
    text = (EXAMPLES / "faq.md").read_text()[:2500]
    calls = []
    real = sensitivity._key_weights
    monkeypatch.setattr(sensitivity, "_key_weights", lambda *a, **k: calls.append(1) or real(*a, **k))
    import kdnctl.ingest.prefix as prefix

    prefill = prefix.prefill
    for recorded, forwards in ((True, 0), (False, 1)):
        # a store ingested before ingest recorded the queries (bundle format 1.11) runs the forward
        monkeypatch.setattr(prefix, "prefill", lambda *a, **k: prefill(*a, **{**k, "energy_chunk": k["energy_chunk"]
                                                                             if recorded else None}))
        st, bundles = _ingest(tmp_path / f"store-{recorded}", tiny_lm, text)
        assert all((QUERY_ENERGY in b.tensors) == recorded for b in bundles)
        with st.writer():
            # the first compress of a store calibrates the tiny model's key basis (a forward of its own)
            compress_document(st, "doc.md", CompressRecipe(budget=0.25), lm=tiny_lm)
            sensitivity.forget_key_weights()
            calls.clear()
            out = compress_document(st, "doc.md", CompressRecipe(budget=0.25), lm=tiny_lm, label="again")
        assert out.status == "compressed" and len(calls) == forwards, (recorded, calls)


def test_a_refit_keeps_the_weights_of_its_own_forward(tiny_lm, tmp_path, monkeypatch):
    """With a value refit the forward runs anyway (for the document's queries): its weights stand,
    so an evicting recipe stores what it stored before ingest recorded the queries."""
    text = (EXAMPLES / "faq.md").read_text()[:2500]
    st, _ = _ingest(tmp_path / "store", tiny_lm, text)
    recorded = []
    real = sensitivity.recorded_key_weights
    import kdnctl.compress.stages.precision as precision

    monkeypatch.setattr(precision, "recorded_key_weights", lambda *a, **k: recorded.append(1) or real(*a, **k))
    with st.writer():
        refit = CompressRecipe(budget=0.2)  # below 0.25 the default evicts and refits (0.083 is below this model's reach)
        assert refit.refit and refit.keep < 1
        compress_document(st, "doc.md", refit, lm=tiny_lm)
        assert recorded == []
        compress_document(st, "doc.md", CompressRecipe(budget=0.25), lm=tiny_lm)
        assert recorded == [1]


@pytest.mark.parametrize("bad, why", [
    (lambda e: e.half(), "float32"),
    (lambda e: e[:, :, :-1].contiguous(), "float32"),
    (lambda e: -e, ">= 0"),
    (lambda e: e.index_fill(0, torch.tensor([0]), float("nan")), "finite"),
])
def test_a_malformed_query_energy_is_refused(tiny_lm, tmp_path, bad, why):
    _, bundles = _ingest(tmp_path / "store", tiny_lm, (EXAMPLES / "faq.md").read_text()[:600])
    b = bundles[0]
    blob = encode_bundle(b)
    assert decode_bundle(blob).tensors[QUERY_ENERGY].shape == b.tensors[QUERY_ENERGY].shape
    broken = KVBundle(meta=b.meta, tensors={**b.tensors, QUERY_ENERGY: bad(b.tensors[QUERY_ENERGY])})
    with pytest.raises(BundleFormatError, match=why):
        encode_bundle(broken)
