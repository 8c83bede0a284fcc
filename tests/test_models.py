"""Every supported decoder architecture, as tiny random models built here from transformers'
config classes (no downloads), through kdnctl's own path: ingest (prefill with kdnctl's
attention) -> store -> load -> next-token logits, against transformers' own forward with the
model's own attention over the same tokens. The document is longer than every sliding window.

``MODELS`` is also the source of docs/models.md's support table (scripts/models_table.py)."""

from __future__ import annotations

import pytest
import torch

from conftest import EXAMPLES, run_cli

TOL = 1e-4
DOC = EXAMPLES / "faq.md"
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
            final_logit_softcapping=30.0, query_pre_attn_scalar=32, **COMMON)),
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
            from kdnctl.model import load_model

            path = build_model_dir(name, tmp_path_factory.mktemp(name), lm.tokenizer)
            made[name] = (path, load_model(path))
        return made[name]
    return get


def own_forward_logits(model_lm, token_ids) -> torch.Tensor:
    """transformers' own forward (the model's own attention implementation): last logits."""
    with torch.inference_mode():
        out = model_lm.model(input_ids=torch.tensor([token_ids]), use_cache=False)
    return out.logits[0, -1].float()


@pytest.mark.parametrize("name", MODELS)
def test_stored_full_matches_transformers(name, built, tmp_path):
    from kdnctl.engine.hf import forward_suffix, load_document
    from kdnctl.model import use_loaded_models
    from kdnctl.models import adapter_for
    from kdnctl.store import Store
    from kdnctl.store.protocol import read_bundle_meta

    path, mlm = built(name)
    store = tmp_path / "s"
    with use_loaded_models(mlm):
        run_cli("ingest", DOC, "--model", path, store=store, check=True)
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
    assert (got[-1] - want).abs().max().item() < TOL


def ingested(name, built, tmp_path):
    from kdnctl.model import use_loaded_models

    path, mlm = built(name)
    store = tmp_path / "s"
    with use_loaded_models(mlm):
        run_cli("ingest", DOC, "--model", path, store=store, check=True)
    return path, mlm, store


@pytest.mark.parametrize("name", MODELS)
def test_compressed_versions_run_and_load(name, built, tmp_path):
    """--budget 0.25 and 0.083 compress and load for every model; the 0.25 version's next-token
    logits stay near the full version's."""
    from kdnctl.engine.hf import forward_suffix, load_document
    from kdnctl.model import use_loaded_models
    from kdnctl.store import Store

    path, mlm, store = ingested(name, built, tmp_path)
    suffix = mlm.tokenizer(SUFFIX, add_special_tokens=False).input_ids
    st = Store(store, create=False)
    full, _ = forward_suffix(mlm, load_document(mlm, st, DOC.name), suffix, last_only=True)
    st.close()
    dist = {}
    for budget in ("0.25", "0.083"):
        with use_loaded_models(mlm):
            proc = run_cli("compress", DOC.name, "--budget", budget, "--model", path, "--json", store=store)
        assert proc.returncode == 0, proc.stderr
        label = json_rows(proc.stdout)[0]["label"]
        st = Store(store, create=False)
        got, _ = forward_suffix(mlm, load_document(mlm, st, DOC.name, label=label), suffix, last_only=True)
        st.close()
        assert torch.isfinite(got).all()
        dist[budget] = torch.softmax(got[-1], -1).sub(torch.softmax(full[-1], -1)).abs().sum().item()
    assert dist["0.25"] < 0.1, dist


def json_rows(stdout: str):
    import json

    data = json.loads(stdout)
    return data if isinstance(data, list) else data.get("rows") or data.get("results") or [data]


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
    from kdnctl.model import use_loaded_models

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
    from kdnctl.model import use_loaded_models

    path, mlm, store = ingested("llama", built, tmp_path)
    with use_loaded_models(mlm):
        proc = run_cli("compress", DOC.name, "--keep", "0.5", "--model", path, store=store)
    assert proc.returncode == 0, proc.stderr


def test_unreachable_budget_names_the_smallest(tmp_path, lm):
    """A model too small for a budget (2 layers, head_dim 16: per-token overheads dominate)."""
    import transformers as T

    from kdnctl.model import load_model, use_loaded_models

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
    line = proc.stderr.strip().splitlines()[0]
    assert "the smallest it reaches here is" in line
    smallest = float(line.split("the smallest it reaches here is ")[1].split()[0])
    with use_loaded_models(mlm):
        ok = run_cli("compress", DOC.name, "--budget", f"{smallest:g}", "--quant", "ec", "--model", model_dir,
                     store=store)
    assert ok.returncode == 0, ok.stderr
