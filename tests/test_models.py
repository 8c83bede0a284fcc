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

    path, mlm = built(name)
    store = tmp_path / "s"
    with use_loaded_models(mlm):
        run_cli("ingest", DOC, "--model", path, store=store, check=True)
    st = Store(store, create=False)
    ctx = load_document(mlm, st, DOC.name)
    windows = [a.window for a in adapter_for(mlm.model).layer_attention() if a.window]
    assert all(ctx.n_tokens > 2 * w for w in windows)
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
