"""Composable independent chunks: RoPE re-rotation, compose/recompute, independent ingest,
BM25 retrieval, and `ask --chunks/--retrieve` through the CLI.

Tolerances (fp32 on CPU):
* re-rotating a stored key from p to p+d vs computing it at p+d: max abs error <= 1e-4 x max|k|
  (measured ~3e-6 at p=24,d=100 and ~5e-5 at p=500,d=3000: HF forms angles as fp32 pos*freq);
* compose(recompute=1) vs a full prefill of the same tokens: next-token logits max abs diff <= 1e-3
  (measured ~1e-4); fresh layers (<= check layer) vs full prefill K/V: <= 1e-4.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kdnctl.ingest.corpus import Document

from conftest import cli_json, run_cli
from kdnctl.quant import layer_kv
from kdnctl.models.cache_args import cache_arg

P1 = ("The Orrin valley cooperative grows pears and quinces on terraces above the river. Its members "
      "meet every spring to agree on picking dates and on the price of cider for the coming year.")
P2 = ("The cooperative's oldest press was built from zorbulite, a rare green stone quarried on the "
      "north ridge; the press still works and is used for the first cider of every season.")
SHARED = ("Visitors are welcome on Saturdays between ten and four. Guided walks start at the mill "
          "gate and last about ninety minutes, including a tasting at the old barn near the orchard.")
P3 = ("The harbour authority of Kestwick publishes tide tables every month. Small boats must register "
      "with the harbour master before mooring at the east pier during the summer festival weeks.")
CHUNK = 48
QUESTION = "What stone was the oldest press built from?"


def _doc(doc_id: str, text: str) -> Document:
    import hashlib

    return Document(doc_id, text, doc_id, hashlib.sha256(text.encode()).hexdigest())


@pytest.fixture(scope="module")
def store(tmp_path_factory, lm):
    from kdnctl.ingest import IngestOptions, ingest_documents
    from kdnctl.ingest.independent import ingest_independent
    from kdnctl.store import Store

    st = Store(tmp_path_factory.mktemp("compose-store"))
    a = _doc("a.md", "\n\n".join([P1, P2, SHARED]))
    b = _doc("b.md", "\n\n".join([P3, SHARED]))
    ingest_documents(st, lm, [a], IngestOptions(chunk_tokens=64, stats=False))  # prefix "full" first
    rep = ingest_independent(st, lm, [a, b], IngestOptions(chunk_tokens=CHUNK, stats=False))
    st.first_report = rep
    yield st
    st.close()


@pytest.fixture(scope="module")
def parts(store, lm):
    """(header bundle, chunk bundles of a.md in document order)."""
    from kdnctl.engine.retrieval import list_chunks, load_chunk_bundles

    header, bundles, _ = load_chunk_bundles(lm, store, list_chunks(store, doc_id="a.md"))
    return header, bundles


# -- RoPE re-rotation ------------------------------------------------------------------------

def _keys_at(lm, ids: torch.Tensor, start: int) -> list[torch.Tensor]:
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.model.config)
    with torch.inference_mode():
        lm.model.model(input_ids=ids, position_ids=torch.arange(start, start + ids.shape[1])[None],
                       **cache_arg(lm.model.model, cache), use_cache=True)
    return [layer.keys[0] for layer in cache.layers]


@pytest.mark.parametrize("p,d", [(24, 100), (500, 3000)])
def test_rerotate_equals_direct_rope(lm, p, d):
    from kdnctl.engine.independent import rerotate_keys, rope_inv_freq

    ids = torch.tensor([lm.tokenizer("The quick brown fox jumps over the lazy dog.").input_ids])
    inv = rope_inv_freq(lm)
    for layer, (at_p, at_pd) in enumerate(zip(_keys_at(lm, ids, p), _keys_at(lm, ids, p + d))):
        err = (rerotate_keys(at_p, d, inv) - at_pd).abs().max() / at_pd.abs().max()
        assert err <= 1e-4, f"layer {layer}: relative error {err:.2e}"


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rerotate_exact_for_linear_and_llama3(rope):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    from kdnctl.engine.independent import rerotate_keys, rope_inv_freq

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=2048,
                      num_hidden_layers=1, intermediate_size=64, vocab_size=64,
                      rope_parameters={"rope_theta": 10000.0, **rope})
    model = LlamaForCausalLM(cfg)
    rot = model.base_model.rotary_emb
    inv = rope_inv_freq(SimpleNamespace(model=model))
    torch.manual_seed(0)
    k = torch.randn(1, 2, 10, 32)
    p, d = torch.arange(5, 15)[None], 777

    def at(pos):
        cos, sin = rot(k, pos)
        return apply_rotary_pos_emb(k, k, cos, sin)[1]

    want = at(p + d)
    assert ((rerotate_keys(at(p), d, inv) - want).abs().max() / want.abs().max()) <= 1e-4


def test_unsupported_rope_type_refused():
    from kdnctl.engine.independent import rope_inv_freq
    from kdnctl.errors import UnsupportedError

    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32, num_hidden_layers=1, intermediate_size=64,
                      vocab_size=64, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0,
                                                      "original_max_position_embeddings": 1024})
    with pytest.raises(UnsupportedError, match="yarn"):
        rope_inv_freq(SimpleNamespace(model=LlamaForCausalLM(cfg)))


# -- compose -----------------------------------------------------------------------------------

def test_recompute_one_equals_full_prefill(lm, parts):
    from kdnctl.engine.independent import compose
    from kdnctl.engine.hf import forward_suffix
    from kdnctl.ingest.prompting import PromptFormat

    header, chunks = parts
    order = [chunks[2], chunks[0], chunks[1]]  # not the document order: every chunk moves
    q = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, QUESTION)
    info: dict = {}
    ctx = compose(lm, order, header, q, recompute=1.0, info=info)
    assert info["recomputed_tokens"] == ctx.n_tokens - header.n_tokens
    got, _ = forward_suffix(lm, ctx, q)
    full, cache = forward_suffix(lm, None, ctx.token_ids + q)
    assert (got - full[-len(q):]).abs().max() <= 1e-3

    # partial recompute: layers <= check layer are recomputed fresh for every token (exact)
    info = {}
    part = compose(lm, order, header, q, recompute=0.3, info=info)
    assert 0 < info["recomputed_tokens"] < ctx.n_tokens - header.n_tokens
    n = part.n_tokens
    for layer in range(info["check_layer"] + 1):
        assert (part.keys[layer] - cache.layers[layer].keys[:, :, :n]).abs().max() <= 1e-4
        assert (part.values[layer] - cache.layers[layer].values[:, :, :n]).abs().max() <= 1e-4


def test_recompute_zero_is_rerotated_concatenation(lm, parts):
    from kdnctl.engine.independent import compose, rerotate_keys, rope_inv_freq
    from kdnctl.engine.hf import generate
    from kdnctl.ingest.prompting import PromptFormat

    header, chunks = parts
    order = [chunks[1], chunks[0]]
    ctx = compose(lm, order, header, recompute=0.0)
    inv = rope_inv_freq(lm)
    h = header.n_tokens
    assert ctx.next_position == h + sum(c.n_tokens for c in order)
    assert ctx.token_ids == header.token_ids.tolist() + sum((c.token_ids.tolist() for c in order), [])
    for layer in (0, 17, 29):
        hk, hv = layer_kv(header, layer)
        k1, v1 = layer_kv(order[0], layer)  # placed where it was prefilled: unchanged
        k2, v2 = layer_kv(order[1], layer)  # moved by len(order[0])
        want_k = torch.cat([hk, k1, rerotate_keys(k2, order[0].n_tokens, inv)], dim=1)
        assert torch.equal(ctx.keys[layer][0], want_k)
        assert torch.equal(ctx.values[layer][0], torch.cat([hv, v1, v2], dim=1))
    q = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, QUESTION)
    assert generate(lm, ctx, q, max_new_tokens=3).token_ids


# -- independent ingest ------------------------------------------------------------------------

def test_independent_ingest_header_once_chunks_by_content(lm, store):
    from kdnctl.ingest.chunking import chunk_content_hash
    from kdnctl.ingest import IngestOptions
    from kdnctl.ingest.independent import HEADER_INDEX, ingest_independent, read_bundle_meta

    va, vb = store.get_version("a.md", "independent"), store.get_version("b.md", "independent")
    assert va.mode == vb.mode == "independent"
    assert store.get_version("a.md", "full").doc_version == va.doc_version  # coexists with prefix mode
    (ha,), (hb,) = ([c for c in v.chunks if c.index == HEADER_INDEX] for v in (va, vb))
    assert ha.object == hb.object and ha.token_start == 0
    a_chunks = [c for c in va.chunks if c.index >= 0]
    b_chunks = [c for c in vb.chunks if c.index >= 0]
    assert len(a_chunks) == 3 and len(b_chunks) == 2  # one chunk per paragraph at this budget
    assert a_chunks[2].chain_hash == b_chunks[1].chain_hash and a_chunks[2].object == b_chunks[1].object
    rep = store.first_report
    assert rep.chunks_stored == 4 and rep.chunks_reused == 1
    for c in a_chunks:
        meta = read_bundle_meta(store, c.object)
        ids = lm.tokenizer(meta["text"], add_special_tokens=False).input_ids
        assert c.chain_hash == chunk_content_hash(ids, lm.fingerprint) == meta["chain_hash"]
        assert (c.token_start, meta["mode"]) == (ha.token_end, "independent")
    objects = {p.name for p in store.objects_dir.rglob("*") if p.is_file()}
    assert {c.object for c in va.chunks + vb.chunks} <= objects
    again = ingest_independent(store, lm, [_doc("a.md", "\n\n".join([P1, P2, SHARED]))],
                               IngestOptions(chunk_tokens=CHUNK, stats=False))
    assert again.unchanged == ["a.md"] and again.chunks_stored == 0
    assert store.verify() == []


# -- retrieval ---------------------------------------------------------------------------------

def test_bm25_ranks_rare_term_first(store):
    from kdnctl.engine.retrieval import BM25, retrieve, tokenize

    bm = BM25([tokenize(t) for t in (P1, P2, SHARED, P3)])
    scores = bm.scores(tokenize("Which press is made of zorbulite?"))
    assert max(range(4), key=scores.__getitem__) == 1
    hits = retrieve(store, "zorbulite", 2)
    assert hits[0].id == "a.md#1" and hits[0].score > hits[1].score
    assert len({h.content_hash for h in retrieve(store, "visitors saturdays guided walks", 5)}) == 4  # shared once


# -- CLI ---------------------------------------------------------------------------------------

def test_cli_ingest_independent_and_ask_chunks_retrieve(tmp_path):
    (tmp_path / "a.md").write_text("\n\n".join([P1, P2, SHARED]) + "\n")
    (tmp_path / "b.md").write_text("\n\n".join([P3, SHARED]) + "\n")
    st = tmp_path / "store"
    rep = cli_json("ingest", tmp_path / "a.md", tmp_path / "b.md", "--mode", "independent",
                   "--chunk-tokens", str(CHUNK), "--no-stats", store=st)
    assert rep["mode"] == "independent" and rep["chunks_stored"] == 4 and rep["chunks_reused"] == 1
    out = cli_json("ask", "--chunks", "b.md#0,a.md#1", QUESTION, "--recompute", "0.3",
                   "--max-new-tokens", "8", "--compare", store=st)
    assert [c["id"] for c in out["chunks"]] == ["b.md#0", "a.md#1"]
    assert out["recomputed_tokens"] > 0 and out["answer"] and "full" in out
    out = cli_json("ask", "--retrieve", "2", QUESTION + " zorbulite", "--recompute", "0",
                   "--max-new-tokens", "8", store=st)
    assert out["chunks"][0]["id"] == "a.md#1" and len(out["chunks"]) == 2 and out["recomputed_tokens"] == 0
    out = cli_json("ask", "a.md", QUESTION, "--version", "independent", "--recompute", "0",
                   "--max-new-tokens", "4", store=st)
    assert [c["id"] for c in out["chunks"]] == ["a.md#0", "a.md#1", "a.md#2"]
    bad = run_cli("ask", "--chunks", "a.md#9", QUESTION, store=st)
    assert bad.returncode == 4 and "no independent chunk" in bad.stderr
