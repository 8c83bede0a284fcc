"""Compression end to end with the real model: new labelled versions, exact budgets, loader
support for pruned and quantized bundles, recipes, eval output, bad budgets."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import EXAMPLES, REPO, cli_json, run_cli

from kdnctl.format.bundle import decode_bundle
from kdnctl.compress.document import CompressRecipe, compress_document
from kdnctl.ingest.corpus import read_corpus
from kdnctl.engine.hf import forward_suffix, generate, load_document
from kdnctl.evaluation.qa import evaluate, load_qa
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.ingest.prompting import PromptFormat
from kdnctl.store import Store

pytestmark = pytest.mark.model
DOC = "faq.md"


@pytest.fixture(scope="module")
def faq_store(tmp_path_factory, lm):
    docs_dir = tmp_path_factory.mktemp("docs")
    text = (EXAMPLES / DOC).read_text()
    ids = lm.tokenizer(text, add_special_tokens=False).input_ids[:700]
    (docs_dir / DOC).write_text(lm.tokenizer.decode(ids))
    docs, _ = read_corpus([docs_dir])
    root = tmp_path_factory.mktemp("store")
    store = Store(root)
    ingest_documents(store, lm, docs, IngestOptions(chunk_tokens=128))
    yield store, docs_dir
    store.close()


def _compress(store, recipe, lm=None, **kw):
    with store.writer():
        return compress_document(store, DOC, recipe, lm=lm, **kw)


@pytest.mark.parametrize("method", ["kvcrush", "snapkv", "h2o", "streaming", "knorm", "random", "pyramid:snapkv", "spans"])
def test_every_method_meets_budget_and_loads(lm, faq_store, method):
    store, _ = faq_store
    # h2o reads `accum`, which default ingest does not record: compress computes it with the model
    res = _compress(store, CompressRecipe(budget=None, keep=0.25, method=method, scorer="window"), lm=lm if method == "h2o" else None)
    version = store.get_version(DOC, res.label)
    assert version.parent == "full" and version.recipe["steps"][-1]["method"] == method.split(":")[-1]
    bundles = [decode_bundle(store.read_object(c.object)) for c in version.chunks]
    n = store.get_version(DOC).n_tokens
    kept = [sum(b.layer_len(i) for b in bundles) for i in range(30)]
    if method == "pyramid:snapkv":
        assert sum(kept) == 30 * round(0.25 * n) and kept[0] > kept[-1]
    else:
        assert kept == [round(0.25 * n)] * 30
    for b in bundles:  # every head of a layer keeps the same tokens count, sorted positions
        pos = b.layer_positions(3)
        if pos.numel() == 0:  # e.g. streaming keeps nothing from middle chunks
            continue
        assert (pos.diff(dim=1) > 0).all() and pos.min() >= b.meta["token_start"] and pos.max() < b.meta["token_end"]
    # the prompt header (recorded at ingest) is never pruned, in any layer or head
    header = bundles[0].meta["header_tokens"]
    assert header == len(PromptFormat.for_tokenizer(lm.tokenizer).header_ids(lm.tokenizer)) > 4
    for i in range(30):
        assert (bundles[0].layer_positions(i)[:, :header] == torch.arange(header)).all()
    ctx = load_document(lm, store, DOC, res.label)
    assert ctx.next_position == n and ctx.keys[0].shape[2] == kept[0]
    q = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, "What does the tool library lend?")
    out = generate(lm, ctx, q, max_new_tokens=8)
    assert out.answer
    # Same recipe again: a no-op.
    assert _compress(store, CompressRecipe(budget=None, keep=0.25, method=method, scorer="window")).status == "unchanged"


def test_pruned_load_positions_continue_from_original_length(lm, faq_store):
    """A budget of 1 through the pruning path keeps every token: logits equal the full cache."""
    store, _ = faq_store
    res = _compress(store, CompressRecipe(budget=None, keep=1.0, method="kvcrush", quant="none"), label="b1-copy")
    q = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, "Is there a late fee?")
    a, _ = forward_suffix(lm, load_document(lm, store, DOC, res.label), q)
    b, _ = forward_suffix(lm, load_document(lm, store, DOC, "full"), q)
    assert (a[-1] - b[-1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("quant,max_kl", [("int8", 0.01), ("int4", 0.5), ("fp8", 0.2), ("mixed", 0.5)])
def test_quantized_versions_close_to_full(lm, faq_store, quant, max_kl):
    store, _ = faq_store
    res = _compress(store, CompressRecipe(budget=None, keep=1.0, quant=quant))
    full_v, q_v = store.get_version(DOC), store.get_version(DOC, res.label)
    assert q_v.nbytes < full_v.nbytes / (3 if quant != "mixed" else 5)
    q = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, "How much is the membership?")
    a, _ = forward_suffix(lm, load_document(lm, store, DOC, res.label), q)
    b, _ = forward_suffix(lm, load_document(lm, store, DOC, "full"), q)
    pa, pb = torch.log_softmax(a[-1], -1), torch.log_softmax(b[-1], -1)
    kl = (pb.exp() * (pb - pa)).sum().item()
    assert 0 <= kl < max_kl, kl


def test_offline_reconstruct_scorer_and_combined(lm, faq_store):
    store, _ = faq_store
    res = _compress(store, CompressRecipe(budget=None, keep=0.25, method="kvcrush", scorer="hybrid", quant="int4"), lm=lm)
    assert res.label == "kvcrush-k0.25-int4" and res.ratio > 8
    ctx = load_document(lm, store, DOC, res.label)
    assert ctx.keys[0].shape[2] == round(0.25 * ctx.n_tokens)


@pytest.mark.parametrize("budget", ["0", "-0.5", "1.5", "nan", "abc"])
def test_bad_budget_clear_error(faq_store, budget, tmp_path):
    store, _ = faq_store
    before = sorted(v.label for v in store.list_versions(DOC))
    proc = run_cli("compress", DOC, "--budget", budget, "--scorer", "window", store=store.root)
    assert proc.returncode == 2, proc.stderr
    assert "budget" in proc.stderr.lower() and "Traceback" not in proc.stderr
    assert sorted(v.label for v in store.list_versions(DOC)) == before


def test_recipe_run_and_eval_json(lm, faq_store, tmp_path):
    store, docs_dir = faq_store
    recipe = tmp_path / "r.toml"
    recipe.write_text('name = "t"\nlabel = "snap-int8"\n[ingest]\nchunk_tokens = 128\n'
                      '[compress]\nmethod = "snapkv"\nbudget = 0.5\nscorer = "window"\nquant = "int8"\n')
    out = cli_json("run", recipe, docs_dir, store=store.root)
    assert out["compress"][0]["label"] == "snap-int8" and out["ingest"]["unchanged"] == [DOC]
    again = cli_json("run", recipe, docs_dir, store=store.root)
    assert again["compress"][0]["status"] == "unchanged"
    qa = tmp_path / "qa.jsonl"
    items = [json.loads(l) for l in (REPO / "examples" / "qa.jsonl").read_text().splitlines() if l.strip()]
    qa.write_text("\n".join(json.dumps(i) for i in items if i["doc"] == DOC and i["position"] == "start"))
    result = cli_json("eval", "--qa", qa, "--versions", "snap-int8", "--probes", "1", "--max-new-tokens", "16",
                      store=store.root)
    labels = [v["label"] for v in result["versions"]]
    assert labels == ["full", "snap-int8"]
    full, snap = result["versions"]
    for v in result["versions"]:
        assert {"label", "accuracy", "answer_nll", "kl", "bytes_per_token", "compression_ratio"} <= set(v)
    assert full["kl"] == 0 and snap["kl"] > 0 and snap["compression_ratio"] > 4
