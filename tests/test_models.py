"""Every supported decoder architecture, as tiny random models built here from transformers'
config classes (no downloads), through kdnctl's own path: ingest (prefill with kdnctl's
attention) -> store -> load -> next-token logits, against transformers' own forward with the
model's own attention over the same tokens. The document is longer than every sliding window.

``MODELS`` is also the source of docs/models.md's support table (scripts/models_table.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import EXAMPLES, REPO, run_cli

TOL = 1e-4
DOC = Path(__file__).parent / "fixtures" / "models_doc.md"  # 535 tokens of examples/corpus/faq.md
SUFFIX = "\nQuestion: when does the depot open?\nAnswer:"
COMMON = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=4096)


def _configs():
    import transformers as T

    return {
        "llama": ("Llama (GQA)", lambda v: T.LlamaConfig(vocab_size=v, num_key_value_heads=2, **COMMON)),
        "llama3-rope": ("Llama, llama3 RoPE scaling", lambda v: T.LlamaConfig(
            vocab_size=v, num_key_value_heads=2, rope_parameters={
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}, **COMMON)),
        "qwen2": ("Qwen2 (q/k/v bias)", lambda v: T.Qwen2Config(vocab_size=v, num_key_value_heads=2, **COMMON)),
        "qwen3": ("Qwen3 (q/k norm)", lambda v: T.Qwen3Config(vocab_size=v, num_key_value_heads=2, head_dim=32,
                                                            **COMMON)),
        "mistral": ("Mistral, sliding window 96", lambda v: T.MistralConfig(
            vocab_size=v, num_key_value_heads=2, sliding_window=96, **COMMON)),
        "gemma2": ("Gemma2, window 64, soft-cap 5 (binding)", lambda v: T.Gemma2Config(
            vocab_size=v, num_key_value_heads=2, head_dim=32, sliding_window=64, attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0, query_pre_attn_scalar=32, initializer_range=0.1, **COMMON)),
        "gemma3": ("Gemma3, mixed layers, RoPE per layer type", lambda v: T.Gemma3TextConfig(
            vocab_size=v, num_key_value_heads=1, head_dim=64, sliding_window=80,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}},
            **COMMON)),
        "phi3": ("Phi3 (fused qkv)", lambda v: T.Phi3Config(vocab_size=v, num_key_value_heads=2, pad_token_id=0,
                                                          **COMMON)),
        "gpt-neox": ("GPT-NeoX (interleaved qkv, partial rotary)", lambda v: T.GPTNeoXConfig(
            vocab_size=v, rotary_pct=0.25, **COMMON)),
        "olmo2": ("OLMo2 (q/k norm over all heads)", lambda v: T.Olmo2Config(vocab_size=v, num_key_value_heads=2,
                                                                            **COMMON)),
    }


MODELS = list(_configs())


def build_model_dir(name: str, path, tokenizer):
    """Save a tiny random ``name`` model with ``tokenizer`` as a HF folder."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _configs()[name][1](max(len(tokenizer), 49152))
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory, lm):
    made = {}

    def get(name):
        if name not in made:
            from kdnctl.models.load import load_model

            path = build_model_dir(name, tmp_path_factory.mktemp(name), lm.tokenizer)
            made[name] = (path, load_model(path))
        return made[name]
    return get


def own_forward_logits(model_lm, token_ids) -> torch.Tensor:
    """transformers' own forward (the model's own attention implementation): last logits."""
    with torch.inference_mode():
        out = model_lm.model(input_ids=torch.tensor([token_ids]), use_cache=False)
    return out.logits[0, -1].float()


def identity_gap(mlm, store) -> float:
    """max |logit difference| of the next token after the stored full version and SUFFIX,
    against transformers' own forward over the same tokens."""
    from kdnctl.engine.hf import forward_suffix, load_document
    from kdnctl.models import adapter_for
    from kdnctl.store import Store
    from kdnctl.store.protocol import read_bundle_meta

    st = Store(store, create=False)
    ctx = load_document(mlm, st, DOC.name)
    windows = [a.window for a in adapter_for(mlm.model).layer_attention() if a.window]
    assert all(ctx.n_tokens > 2 * w for w in windows)
    # sliding-window layers hold every token, and the bundle says so
    assert all(k.shape[2] == ctx.n_tokens for k in ctx.keys)
    meta = read_bundle_meta(st, st.list_versions(DOC.name)[0].chunks[0].object)["model"]
    if windows:
        assert [a.get("stored") for a in meta["attention"] if a["kind"] == "sliding"] == ["whole"] * len(windows)
    suffix = mlm.tokenizer(SUFFIX, add_special_tokens=False).input_ids
    got, _ = forward_suffix(mlm, ctx, suffix, last_only=True)
    want = own_forward_logits(mlm, ctx.token_ids + suffix)
    st.close()
    return (got[-1] - want).abs().max().item()


def ingested(name, built, tmp_path):
    from kdnctl.models.load import use_loaded_models

    path, mlm = built(name)
    store = tmp_path / "s"
    with use_loaded_models(mlm):
        run_cli("ingest", DOC, "--model", path, store=store, check=True)
    return path, mlm, store


@pytest.mark.parametrize("name", MODELS)
def test_stored_full_matches_transformers(name, built, tmp_path):
    _, mlm, store = ingested(name, built, tmp_path)
    assert identity_gap(mlm, store) < TOL


def compressed_distance(mlm, path, store, budget: str) -> tuple[float, float]:
    """Compress at ``budget`` (the CLI's defaults) and load it: (total variation distance of the
    next-token distribution from the full version's, stored bytes / fp16 bytes)."""
    from kdnctl.engine.hf import forward_suffix, load_document
    from kdnctl.models.load import use_loaded_models
    from kdnctl.store import Store

    suffix = mlm.tokenizer(SUFFIX, add_special_tokens=False).input_ids
    with use_loaded_models(mlm):
        proc = run_cli("compress", DOC.name, "--budget", budget, "--model", path, "--json", store=store)
    assert proc.returncode == 0, proc.stderr
    row = json_rows(proc.stdout)[0]
    st = Store(store, create=False)
    full, _ = forward_suffix(mlm, load_document(mlm, st, DOC.name), suffix, last_only=True)
    got, _ = forward_suffix(mlm, load_document(mlm, st, DOC.name, label=row["label"]), suffix, last_only=True)
    st.close()
    assert torch.isfinite(got).all()
    tv = 0.5 * torch.softmax(got[-1], -1).sub(torch.softmax(full[-1], -1)).abs().sum().item()
    return tv, row["fraction_of_fp16"]


@pytest.mark.parametrize("name", MODELS)
def test_compressed_versions_run_and_load(name, built, tmp_path):
    """--budget 0.25 and 0.083 compress and load for every model; the 0.25 version's next-token
    distribution stays near the full version's."""
    path, mlm, store = ingested(name, built, tmp_path)
    tv = {b: compressed_distance(mlm, path, store, b)[0] for b in ("0.25", "0.083")}
    assert tv["0.25"] < 0.05, tv  # the default model (SmolLM2) on the same document: 0.059 (docs/models.md)


def json_rows(stdout: str):
    import json

    data = json.loads(stdout)
    return data["results"]


REFUSED = {
    "encoder-decoder": (lambda T: T.T5Config(d_model=64, num_layers=2, num_heads=2), "encoder-decoder"),
    "state-space": (lambda T: T.MambaConfig(hidden_size=64, num_hidden_layers=2), "state-space"),
    "hybrid": (lambda T: T.JambaConfig(hidden_size=64, num_hidden_layers=2), "state-space"),
    "multimodal": (lambda T: T.LlavaConfig(), "multimodal"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_unsupported_architectures_refused_in_one_line(kind, tmp_path):
    import transformers as T

    make, words = REFUSED[kind]
    model_dir = tmp_path / kind
    make(T).save_pretrained(model_dir)
    store = tmp_path / "s"
    proc = run_cli("ingest", DOC, "--model", model_dir, store=store)
    assert proc.returncode == 10, proc.stderr
    first = proc.stderr.strip().splitlines()[0]
    assert words in first and "unexpected" not in first
    assert not (store / "objects").exists() or not any((store / "objects").rglob("*.*"))


def test_exports_refuse_what_the_engine_cannot_hold(built, tmp_path):
    from kdnctl.models.load import use_loaded_models

    path, mlm, store = ingested("mistral", built, tmp_path)
    with use_loaded_models(mlm):
        lmc = run_cli("export", "lmcache", DOC.name, "--to", tmp_path / "lmcache", store=store)
        gguf = run_cli("export", "llama-cpp", DOC.name, "--to", tmp_path / "seq.bin", "--model", path, store=store)
    assert lmc.returncode == 13, lmc.stderr
    assert "sliding-window layer" in lmc.stderr.strip().splitlines()[0]
    assert not (tmp_path / "lmcache").exists() or not any((tmp_path / "lmcache").iterdir())
    assert gguf.returncode == 13, gguf.stderr  # a transformers folder: llama.cpp needs a GGUF file
    assert "GGUF" in gguf.stderr.strip().splitlines()[0] and "unexpected" not in gguf.stderr
    assert not (tmp_path / "seq.bin").exists()


def test_keep_without_budget(built, tmp_path):
    from kdnctl.models.load import use_loaded_models

    path, mlm, store = ingested("llama", built, tmp_path)
    with use_loaded_models(mlm):
        proc = run_cli("compress", DOC.name, "--keep", "0.5", "--model", path, store=store)
    assert proc.returncode == 0, proc.stderr


def test_unreachable_budget_names_the_smallest(tmp_path, lm):
    """A model too small for a budget (2 layers, head_dim 16: per-token overheads dominate)."""
    import transformers as T

    from kdnctl.models.load import load_model, use_loaded_models

    torch.manual_seed(0)
    model_dir = tmp_path / "m"
    T.LlamaForCausalLM(T.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).save_pretrained(model_dir)
    lm.tokenizer.save_pretrained(model_dir)
    mlm = load_model(model_dir)
    store = tmp_path / "s"
    with use_loaded_models(mlm):
        run_cli("ingest", DOC, "--model", model_dir, store=store, check=True)
        proc = run_cli("compress", DOC.name, "--budget", "0.083", "--quant", "ec", "--model", model_dir, store=store)
    assert proc.returncode != 0
    # (the first compress of this model first says that it calibrated the model's key basis and
    # measured its Fisher profile)
    line = [x for x in proc.stderr.strip().splitlines() if not x.startswith(("key basis ", "Fisher profile "))][0]
    assert "the smallest it reaches here is" in line
    smallest = float(line.split("the smallest it reaches here is ")[1].split()[0])
    with use_loaded_models(mlm):
        ok = run_cli("compress", DOC.name, "--budget", f"{smallest:g}", "--quant", "ec", "--model", model_dir,
                     store=store)
    assert ok.returncode == 0, ok.stderr


TABLE_DOC = REPO / "docs" / "models.md"
TABLE_HEAD = ("| model | class | projections | layers: attention | soft-cap | RoPE | KV heads x head dim |")


def support_row(name: str, mlm) -> str:
    """The static part of ``name``'s row in docs/models.md, from the adapter's view of the model."""
    from kdnctl.models import adapter_for

    a = adapter_for(mlm.model)
    la = a.layer_attention()
    layers = " / ".join(f"window {x.window}" if x.window else "full" for x in la)
    caps = sorted({x.softcap for x in la if x.softcap})
    rope = getattr(mlm.model.config, "rope_parameters", None) or {}
    if all(isinstance(v, dict) for v in rope.values()) and rope:
        rope_s = "; ".join(f"{k.split('_')[0]}: {v.get('rope_type', 'default')}" for k, v in sorted(rope.items()))
    else:
        rope_s = str(rope.get("rope_type", "default"))
    frac = a.rotary_dim() / a.head_dim
    if frac != 1:
        rope_s += f", {frac:g} of each head"
    return (f"| {_configs()[name][0]} | {type(mlm.model).__name__} | {a.layout} | {layers} | "
            f"{', '.join(f'{c:g}' for c in caps) or '-'} | {rope_s} | {a.n_kv_heads} x {a.head_dim} |")


def test_support_table_is_current(built):
    """docs/models.md lists every model of the matrix as the adapter sees it (regenerate it with
    scripts/models_table.py, which also measures the numbers)."""
    text = TABLE_DOC.read_text()
    for name in MODELS:
        row = support_row(name, built(name)[1])
        assert row[:-1] in text, f"docs/models.md is stale for {name}: run scripts/models_table.py"


def test_compare_reference_is_the_models_own_attention(built, monkeypatch):
    """``ask --compare``'s full prefill never runs kdnctl's attention: with it made unusable the
    reference still runs, and equals transformers' own forward (Gemma2: window and soft-cap)."""
    from kdnctl.engine import attention as kdn
    from kdnctl.engine.hf import full_prefill_generate

    _, mlm = built("gemma2")
    ids = mlm.tokenizer(DOC.read_text(), add_special_tokens=False).input_ids[:300]
    suffix = mlm.tokenizer(SUFFIX, add_special_tokens=False).input_ids

    def refuse(*_a, **_k):
        raise AssertionError("kdnctl attention used for the reference")

    monkeypatch.setattr(kdn, "kdn_attention", refuse)
    res = full_prefill_generate(mlm, ids, suffix, max_new_tokens=2)
    assert (res.first_logits - own_forward_logits(mlm, ids + suffix)).abs().max().item() < TOL


def test_softcap_binds_in_the_matrix(built):
    """The Gemma2 model's soft-cap changes its output (so the identity test checks it)."""
    _, mlm = built("gemma2")
    ids = mlm.tokenizer(DOC.read_text(), add_special_tokens=False).input_ids[:200]
    with_cap = own_forward_logits(mlm, ids)
    cfg = mlm.model.config
    cap = cfg.attn_logit_softcapping
    try:
        for a in mlm.model.base_model.layers:
            a.self_attn.attn_logit_softcapping = None
        without = own_forward_logits(mlm, ids)
    finally:
        for a in mlm.model.base_model.layers:
            a.self_attn.attn_logit_softcapping = cap
    assert (with_cap - without).abs().max().item() > 100 * TOL


def test_architecture_names_only_in_the_adapter():
    """No module of kdnctl outside kdnctl/models spells a decoder attribute or a projection name."""
    import re

    pattern = re.compile(r"\bmodel\.model\b|\.(q_proj|k_proj|v_proj|o_proj|qkv_proj|query_key_value|rotary_emb)\b")
    found = [f"{p.relative_to(REPO)}:{i}" for p in (REPO / "kdnctl").rglob("*.py") if "models" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, found


def test_key_basis_registered_for_a_new_model(built, tmp_path, monkeypatch):
    """A model without a shipped key basis: one calibrated for it (as scripts/calibrate_key_basis.py
    does, here on another text) and registered in a basis directory is used by ``key_basis=model``
    (no store basis is calibrated), and the version loads."""
    from kdnctl.engine.hf import forward_suffix, load_document
    from kdnctl.models.load import use_loaded_models
    from kdnctl.format.key_basis import ENV, register
    from kdnctl.quant.basis import calibrate, key_samples
    from kdnctl.store import Store

    path, mlm, store = ingested("qwen3", built, tmp_path)
    other = mlm.tokenizer((EXAMPLES / "zephyr-x200-manual.md").read_text()).input_ids[:600]
    register(calibrate(key_samples(mlm, [other])), mlm.fingerprint, tmp_path / "bases")
    monkeypatch.setenv(ENV, str(tmp_path / "bases"))
    with use_loaded_models(mlm):
        proc = run_cli("compress", DOC.name, "--budget", "0.25", "--option", "key_basis=model", "--model", path,
                       "--json", store=store)
    assert proc.returncode == 0, proc.stderr
    assert "calibrated" not in proc.stderr
    st = Store(store, create=False)
    from kdnctl.store.bases import basis_records

    assert basis_records(st) == []
    ctx = load_document(mlm, st, DOC.name, label=json_rows(proc.stdout)[0]["label"])
    got, _ = forward_suffix(mlm, ctx, mlm.tokenizer(SUFFIX, add_special_tokens=False).input_ids, last_only=True)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("name", MODELS)
def test_refit_queries_read_from_the_stored_cache_equal_the_forwards(name, built, tmp_path):
    """The value refit's queries of a long document come from a pass over the picked rows alone
    that reads the stored K/V (``cached_queries``): for every architecture (sliding windows,
    soft-capping, RoPE per layer type, fused and interleaved projections, partial rotary) they
    equal those a forward over the whole document captures, on rows spread over the document
    (its first and last token among them, windows spanned)."""
    from kdnctl.compress.refit import cached_queries, picked_queries, query_rows
    from kdnctl.engine.hf import load_document
    from kdnctl.models import adapter_for
    from kdnctl.store import Store

    _, mlm, store = ingested(name, built, tmp_path)
    st = Store(store, create=False)
    ctx = load_document(mlm, st, DOC.name)
    st.close()
    ids = ctx.token_ids
    pick = query_rows(len(ids), 37)
    assert pick[0] == 0 and pick[-1] == len(ids) - 1 and len(pick) == 37
    adapter = adapter_for(mlm.model)
    want: list = [None] * adapter.n_layers

    def on(i, _role, q):
        want[i] = picked_queries(q, pick)

    with adapter.capture(("q",), on=on), torch.no_grad():
        adapter.decoder(torch.tensor([ids]), use_cache=False)
    got = cached_queries(mlm, ids, [k[0] for k in ctx.keys], [v[0] for v in ctx.values], pick)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4 * float(w.abs().max()))
    # the rows read their stored K/V: with the values' channels reversed (a change no norm after
    # attention undoes) the last layer's queries move
    moved = cached_queries(mlm, ids, [k[0] for k in ctx.keys], [v[0].flip(-1) for v in ctx.values], pick)
    assert not torch.allclose(moved[-1], want[-1], rtol=1e-2, atol=1e-2 * float(want[-1].abs().max()))
