"""Shared fixtures. TRITON_INTERPRET must be set before any Triton kernel module is imported so
kernel tests can run the Triton path on CPU tensors."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples" / "corpus"


@pytest.fixture(scope="session")
def lm():
    """The real default model (SmolLM2-135M-Instruct), loaded once per test session."""
    from kdnctl.model import load_model

    return load_model()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, lm):
    """A tiny randomly initialised Llama (same tokenizer) saved as a HF folder: a *different*
    model, for fingerprint-mismatch tests and fast plumbing checks."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=lm.tokenizer.vocab_size if lm.tokenizer.vocab_size >= 49152 else 49152,
                      hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)
    model = LlamaForCausalLM(cfg)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    lm.tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_lm(tiny_model_dir):
    """The tiny random model of ``tiny_model_dir``, loaded once per session."""
    from kdnctl.model import load_model

    return load_model(tiny_model_dir)


def run_cli(*args, store=None, env=None, timeout=600, check=False):
    """Run the real `kdnctl` console entry in a subprocess; returns CompletedProcess."""
    import os

    full_env = dict(os.environ)
    full_env.pop("KDNCTL_DEBUG", None)
    if env:
        full_env.update(env)
    cmd = [sys.executable, "-m", "kdnctl.cli.app", *map(str, args)]
    if store is not None:
        cmd += ["--store", str(store)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"kdnctl {args} failed ({proc.returncode}): {proc.stderr}")
    return proc


def cli_json(*args, store=None, **kw):
    proc = run_cli(*args, "--json", store=store, check=True, **kw)
    return json.loads(proc.stdout)
