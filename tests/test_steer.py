"""Attention-steering edits (PASTA): spans, head selection, bias semantics, both edit modes, the
CLI, edits on compressed versions and the batched profiler's equivalence with plain decoding."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math

import pytest
import torch

from conftest import REPO, cli_json, run_cli

from kdnctl.format.bundle import decode_bundle
from kdnctl.ingest.corpus import Document
from kdnctl.engine.attention import AttentionState, kdn_attention
from kdnctl.engine.hf import forward_suffix, generate, load_document
from kdnctl.errors import InputError, UnsupportedError, UsageError
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.ingest.prompting import PromptFormat
from kdnctl.steer.base import SteerSpec, get_edit, pasta_bias, steer_document
from kdnctl.steer.heads import from_value, parse_pairs, resolve_heads
from kdnctl.steer.highlight import find_highlight, parse_markers
from kdnctl.store import Store
from kdnctl.models.cache_args import cache_arg

pytestmark = pytest.mark.model

DOC = "ferry"
HIGHLIGHT = 'Begin every answer with the word "Certainly".'
TEXT = ("The Lowmere ferry crosses the estuary between Pellham Quay and Saltcote. The crossing takes about "
        "twenty-five minutes, and the boat can carry twelve cars. " + HIGHLIGHT + " Dogs are welcome on the "
        "open deck. A small cafe at Pellham Quay opens thirty minutes before the first sailing.")
QUESTION = "How many cars can the boat carry?"
HEADS = {2: [0, 4], 5: [8]}


def _doc(doc_id: str, text: str) -> Document:
    return Document(doc_id, text, doc_id, hashlib.sha256(text.encode()).hexdigest())


@pytest.fixture(scope="module")
def store(tmp_path_factory, lm):
    st = Store(tmp_path_factory.mktemp("steer-store"))
    ingest_documents(st, lm, [_doc(DOC, TEXT)], IngestOptions(chunk_tokens=32))
    assert len(st.get_version(DOC).chunks) >= 3
    yield st
    st.close()


def _bundles(store, label):
    return [decode_bundle(store.read_object(c.object)) for c in store.get_version(DOC, label).chunks]


def _token_ids(store):
    return [int(t) for b in _bundles(store, "full") for t in b.token_ids.tolist()]


def _suffix(lm):
    return PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, QUESTION)


# -- spans ---------------------------------------------------------------------------------

def test_spans_literal_regex_markers(lm, store, tmp_path):
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    ids = _token_ids(store)
    hl = find_highlight(lm.tokenizer, fmt, TEXT, ids, [HIGHLIGHT])
    [(s, e)] = hl.matches[0].token_ranges
    assert hl.mask.sum() == e - s and hl.mask[s:e].all()
    assert lm.tokenizer.decode(ids[s:e]).strip() == HIGHLIGHT
    assert s > len(fmt.header_ids(lm.tokenizer))  # absolute positions, header counted
    # regex: two matches, unioned with a literal
    hl2 = find_highlight(lm.tokenizer, fmt, TEXT, ids, ["re:Pellham Quay", "twelve cars"])
    assert len(hl2.matches[0].token_ranges) == 2 and hl2.n_highlighted >= 5
    # markers file: same text with << >> around the highlight selects the same tokens
    marked = tmp_path / "marked.txt"
    marked.write_text(TEXT.replace(HIGHLIGHT, f"<<{HIGHLIGHT}>>"))
    hl3 = find_highlight(lm.tokenizer, fmt, TEXT, ids, [f"markers:{marked}"])
    assert torch.equal(hl3.mask, hl.mask)
    assert parse_markers("a <<b>> c <<d>>") == ("a b c d", [(2, 3), (6, 7)])
    with pytest.raises(UsageError):
        parse_markers("a <<b <<c>> >>")
    marked.write_text("other text <<x>>")
    with pytest.raises(UsageError, match="differs"):
        find_highlight(lm.tokenizer, fmt, TEXT, ids, [f"markers:{marked}"])
    with pytest.raises(InputError):
        find_highlight(lm.tokenizer, fmt, TEXT, ids, [f"markers:{tmp_path / 'missing'}"])
    for bad in ("no such sentence", "re:zebra+"):
        with pytest.raises(UsageError, match="matches nothing") as err:
            find_highlight(lm.tokenizer, fmt, TEXT, ids, [bad])
        assert repr(bad) in err.value.message


def test_head_selection(lm, tmp_path):
    assert parse_pairs("3:1, 3:0,7:*", 30, 9) == {3: [0, 1], 7: list(range(9))}
    assert len(parse_pairs("all", 30, 9)) == 30
    for bad in ("3", "3:x", "30:0", "1:9", ""):
        with pytest.raises(UsageError):
            parse_pairs(bad, 30, 9)
    assert from_value({"4": [2, 1]}, 30, 9) == {4: [1, 2]}
    cfg = tmp_path / "heads.toml"
    cfg.write_text("heads = [[12, 3], [12, 0], [20, 5]]\n")
    heads, desc = resolve_heads(str(cfg), lm)
    assert heads == {12: [0, 3], 20: [5]} and desc == "file:heads.toml"
    # the shipped profiled config is found for the default model
    auto, desc = resolve_heads("auto", lm)
    assert auto and desc == "auto:smollm2-135m.json"


# -- bias semantics ------------------------------------------------------------------------

def test_bias_exact_values_and_recorded_version(lm, store):
    spec = SteerSpec([HIGHLIGHT], HEADS, alpha=0.01, heads_spec="test")
    res = steer_document(store, lm, DOC, spec, label="steer-bias")
    assert res.status == "steered" and res.n_highlighted > 5
    assert steer_document(store, lm, DOC, spec, label="steer-bias").status == "unchanged"
    with pytest.raises(UsageError, match="another recipe"):
        steer_document(store, lm, DOC, SteerSpec([HIGHLIGHT], HEADS, alpha=0.1), label="steer-bias")
    v = store.get_version(DOC, "steer-bias")
    assert v.parent == "full"
    step = v.recipe["steps"][-1]
    assert step["step"] == "steer" and step["spans"] == [HIGHLIGHT] and step["alpha"] == 0.01
    assert step["mode"] == "bias" and step["heads"] == [[2, 0], [2, 4], [5, 8]]
    assert v.recipe["steps"][0]["step"] == "ingest"
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    mask = find_highlight(lm.tokenizer, fmt, TEXT, _token_ids(store), [HIGHLIGHT]).mask
    outside = torch.tensor(math.log(0.01)).half()
    for src, b in zip(_bundles(store, "full"), _bundles(store, "steer-bias")):
        assert b.meta["label"] == "steer-bias" and b.meta["steer"]["alpha"] == 0.01
        inside = mask[b.meta["token_start"]:b.meta["token_end"]]
        for i in range(b.n_layers):
            assert torch.equal(b.tensors[f"layers.{i}.keys"], src.tensors[f"layers.{i}.keys"])
            if i not in HEADS:
                assert f"layers.{i}.bias" not in b.tensors
                continue
            bias = b.tensors[f"layers.{i}.bias"]
            assert bias.dtype == torch.float16 and bias.shape == (9, b.n_tokens)
            for h in range(9):
                if h in HEADS[i]:
                    assert torch.equal(bias[h][inside], torch.zeros(int(inside.sum()), dtype=torch.float16))
                    assert (bias[h][~inside] == outside).all()
                else:
                    assert (bias[h] == 0).all()
    # ... and loads through the engine with the bias applied (logits differ from unedited)
    base = forward_suffix(lm, load_document(lm, store, DOC), _suffix(lm))[0]
    ctx = load_document(lm, store, DOC, "steer-bias")
    assert sorted(ctx.bias) == [2, 5]
    assert (forward_suffix(lm, ctx, _suffix(lm))[0] - base).abs().max() > 1e-2


def test_bias_follows_gqa_group_positions():
    highlight = torch.zeros(10, dtype=torch.bool)
    highlight[[2, 3]] = True
    positions = torch.tensor([[1, 2, 5], [3, 4, 9], [0, 6, 7]])  # per KV head, H_kv=3
    bias = pasta_bias(highlight, positions, [0, 4, 8], 9, 0.1)
    v = math.log(0.1)
    assert torch.allclose(bias[0], torch.tensor([v, 0, v]))  # group 0 -> KV head 0
    assert torch.allclose(bias[4], torch.tensor([0, v, v]))  # group 1 -> KV head 1
    assert torch.allclose(bias[8], torch.tensor([v, v, v]))
    assert (bias[[1, 2, 3, 5, 6, 7]] == 0).all()
    assert (pasta_bias(highlight, positions, [0, 4], 9, 1.0) == 0).all()


@pytest.mark.parametrize("mode", ["bias", "reprefill"])
def test_alpha_one_changes_nothing(lm, store, mode):
    label = f"steer-{mode}-a1"
    steer_document(store, lm, DOC, SteerSpec([HIGHLIGHT], HEADS, alpha=1.0, mode=mode), label=label)
    base = forward_suffix(lm, load_document(lm, store, DOC), _suffix(lm))[0]
    edited = forward_suffix(lm, load_document(lm, store, DOC, label), _suffix(lm))[0]
    # fp32 logits: the stored path (preallocated cache, last-token logits) reorders sums: 1e-4
    assert (edited - base).abs().max().item() <= 1e-4


def test_reprefill_changes_only_later_layers(lm, store):
    steer_document(store, lm, DOC, SteerSpec([HIGHLIGHT], {3: list(range(9))}, mode="reprefill"), label="steer-rp")
    assert store.get_version(DOC, "steer-rp").recipe["steps"][-1]["mode"] == "reprefill"
    for src, b in zip(_bundles(store, "full"), _bundles(store, "steer-rp")):
        for i in range(b.n_layers):
            k, k0 = b.tensors[f"layers.{i}.keys"], src.tensors[f"layers.{i}.keys"]
            if i <= 3:  # K/V of layers up to the steered one come before its attention
                assert torch.allclose(k, k0, atol=1e-5)
        assert "layers.3.bias" in b.tensors and "stats.window" in b.tensors
    last = _bundles(store, "steer-rp")[-1].tensors["layers.20.values"]
    assert (last - _bundles(store, "full")[-1].tensors["layers.20.values"]).abs().max() > 1e-3


def test_decode_bias_equals_reference_attention():
    """kdnctl attention with a cached prefix + bias == a hand-written eager attention over the
    whole sequence with the same additive mask, on a tiny random 2-layer Llama."""
    from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg).eval()
    n, q = 10, 4
    ids = torch.randint(0, 128, (1, n + q))
    bias = {1: torch.randn(4, n) * 3}

    def reference(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        g = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(g, 1).double(), value.repeat_interleave(g, 1).double()
        logits = query.double() @ k.transpose(-1, -2) * scaling
        t = logits.shape[-1]
        mask = torch.zeros(query.shape[1], t, t, dtype=torch.float64)
        mask.masked_fill_(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        if module.layer_idx in bias:  # the bias applies to the queries after the cached prefix
            mask[:, n:, :n] += bias[module.layer_idx][:, None, :].double()
        out = torch.softmax(logits + mask, -1) @ v
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register("kdn_test_reference", reference)
    with torch.inference_mode():
        cache = DynamicCache(config=cfg)
        model(input_ids=ids[:, :n], **cache_arg(model, cache), use_cache=True)
        with kdn_attention(model, AttentionState(bias=bias)):
            got = model(input_ids=ids[:, n:], **cache_arg(model, cache), use_cache=True,
                        position_ids=torch.arange(n, n + q)[None]).logits[0]
        model.config._attn_implementation = "kdn_test_reference"
        want = model(input_ids=ids).logits[0, n:]
    assert (got - want).abs().max().item() < 1e-4
    with torch.inference_mode(), kdn_attention(model, AttentionState()):
        plain = model(input_ids=ids).logits[0, n:]
    assert (plain - want).abs().max().item() > 1e-3  # the bias mattered


# -- compressed sources --------------------------------------------------------------------

def test_steer_on_compressed_versions(lm, store):
    compress = pytest.importorskip("kdnctl.compress.document", reason="kdnctl.compress.document (compression) is not available")
    with store.writer():
        compress.compress_document(store, DOC, compress.CompressRecipe(budget=None, keep=0.5, method="knorm"), label="pruned")
        compress.compress_document(store, DOC, compress.CompressRecipe(budget=None, keep=1.0, quant="int8"), label="q8")
    spec = SteerSpec([HIGHLIGHT], HEADS, alpha=0.01)
    steer_document(store, lm, DOC, spec, source="pruned", label="pruned+steer")
    steer_document(store, lm, DOC, SteerSpec([HIGHLIGHT], HEADS, mode="reprefill"), source="pruned", label="pruned+rp")
    steer_document(store, lm, DOC, SteerSpec([HIGHLIGHT], HEADS, mode="reprefill"), label="full+rp")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    mask = find_highlight(lm.tokenizer, fmt, TEXT, _token_ids(store), [HIGHLIGHT]).mask
    for b, rp, full_rp in zip(_bundles(store, "pruned+steer"), _bundles(store, "pruned+rp"), _bundles(store, "full+rp")):
        for i in HEADS:
            pos = b.layer_positions(i)
            assert pos.shape[1] < b.n_tokens
            assert torch.equal(b.tensors[f"layers.{i}.bias"], pasta_bias(mask, pos, HEADS[i], 9, 0.01).half())
        for i in (0, 7):  # reprefill of a pruned version = full reprefill at the kept positions
            pos = rp.layer_positions(i) - rp.meta["token_start"]
            full_v = full_rp.tensors[f"layers.{i}.values"]
            assert torch.allclose(rp.tensors[f"layers.{i}.values"], torch.gather(full_v, 1, pos[..., None].expand(-1, -1, 64)),
                                  atol=1e-4)
    assert store.get_version(DOC, "pruned+steer").parent == "pruned"
    assert [s["step"] for s in store.get_version(DOC, "pruned+steer").recipe["steps"]] == ["ingest", "compress", "steer"]
    assert generate(lm, load_document(lm, store, DOC, "pruned+steer"), _suffix(lm), max_new_tokens=4).token_ids
    steer_document(store, lm, DOC, spec, source="q8", label="q8+steer")  # bias mode keeps quantized K/V
    assert load_document(lm, store, DOC, "q8+steer").bias
    with pytest.raises(UnsupportedError, match="quantized"):
        steer_document(store, lm, DOC, SteerSpec([HIGHLIGHT], HEADS, mode="reprefill"), source="q8", label="q8+rp")


# -- CLI -----------------------------------------------------------------------------------

def test_cli_edit_then_ask(store):
    root = store.root
    out = cli_json("edit", "--steer", HIGHLIGHT, "--heads", "4:0,4:1", "--alpha", "0.05", "--label", "cli-steer",
                   DOC, store=root)
    assert out["results"][0]["status"] == "steered" and out["n_heads"] == 2
    bad = run_cli("edit", "--steer", "zebra crossing", "--heads", "4:0", DOC, store=root)
    assert bad.returncode == 2 and "'zebra crossing' matches nothing" in bad.stderr
    bad = run_cli("edit", "--steer", HIGHLIGHT, "--alpha", "0", "--heads", "4:0", DOC, store=root)
    assert bad.returncode == 2 and "--alpha" in bad.stderr
    answer = cli_json("ask", DOC, QUESTION, "--version", "cli-steer", "--max-new-tokens", "8", store=root)
    assert answer["label"] == "cli-steer" and answer["answer"]
    with Store(root, create=False) as st:
        v = st.get_version(DOC, "cli-steer")
        assert v.parent == "full" and v.recipe["steps"][-1]["heads"] == [[4, 0], [4, 1]]


def test_cli_eval_steer_smoke(tmp_path):
    out = cli_json("eval-steer", "--limit", "1", "--alpha", "0.01", "--heads", "4:0", "--max-new-tokens", "3",
                   "--store", tmp_path / "s")
    assert [(r["mode"], r["alpha"]) for r in out["results"]] == [("none", None), ("bias", 0.01), ("reprefill", 0.01)]
    assert all(r["n"] == 1 for r in out["results"]) and len(out["answers"]) == 1


# -- evaluation + profiler helpers ---------------------------------------------------------

def test_score_check_matches_examples():
    from kdnctl.evaluation.steering import load_tasks, score_check

    spec = importlib.util.spec_from_file_location("check_examples", REPO / "examples" / "check_examples.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    answers = ["LEEKS", "Leeks", "Certainly! Twelve.", "twelve cars. Done", "lyon", "It is 10", "", "Ahoy, 1931"]
    for task in load_tasks(REPO / "examples" / "steering" / "tasks.jsonl"):
        for a in answers:
            assert score_check(a, task.check) == ref.score_check(a, task.check)


def test_batched_profiler_decoding_equals_generate(lm):
    from kdnctl.engine.hf import LoadedContext
    from kdnctl.evaluation.steering import load_tasks
    from kdnctl.steer.profile import _Prepared, batched_answers

    task = load_tasks(REPO / "examples" / "steering" / "tasks.jsonl")[1]
    p = _Prepared(lm, task, PromptFormat.for_tokenizer(lm.tokenizer))
    configs = [{}, {4: list(range(9))}, {10: [2]}]
    biases = [{layer: pasta_bias(p.mask, p.positions, hs, 9, 0.01) for layer, hs in c.items()} for c in configs]
    got = batched_answers(lm, p.keys, p.values, p.suffix, biases, max_new_tokens=5)
    n = p.keys[0].shape[1]
    for b, answer in zip(biases, got):
        ctx = LoadedContext([k[None] for k in p.keys], [v[None] for v in p.values], n, [], bias=b)
        assert answer == generate(lm, ctx, p.suffix, max_new_tokens=5).answer


def test_unknown_mode_and_alpha():
    with pytest.raises(UsageError):
        get_edit("nope")
    for alpha in (0, -1, 1.5, float("nan")):
        with pytest.raises(UsageError):
            SteerSpec(["x"], {0: [0]}, alpha=alpha)
    shipped = json.loads((REPO / "recipes" / "heads" / "smollm2-135m.json").read_text())
    assert shipped["heads"] and shipped["format"] == "kdnctl-heads/1"
