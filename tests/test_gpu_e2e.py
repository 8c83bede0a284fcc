"""The real SmolLM2 on a CUDA device: ingest, compress and load on the GPU give the answers the
CPU path proves elsewhere (test_load_path.py). Skipped without CUDA; the lead runs them on the
lent GPU machine (bench/gpu.sh)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from kdnctl.format.bundle import decode_bundle
from kdnctl.compress.document import CompressRecipe, compress_document
from kdnctl.ingest.corpus import Document
from kdnctl.engine.hf import LoadProfile, forward_suffix, generate, load_document
from kdnctl.ingest import IngestOptions, ingest_documents
from kdnctl.ingest.prompting import PromptFormat
from kdnctl.store import Store

from conftest import EXAMPLES
from kdnctl.quant import layer_kv

pytestmark = [pytest.mark.gpu, pytest.mark.model,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DOC = "zephyr-x200-manual.md"


@pytest.fixture(scope="module")
def gpu_lm():
    from kdnctl.models.load import load_model

    return load_model(device="cuda", dtype="float32")


@pytest.fixture(scope="module")
def gpu_store(gpu_lm, tmp_path_factory):
    """~600 tokens of the example manual ingested on the GPU, plus a b1-int8 version."""
    st = _ingested(gpu_lm, tmp_path_factory.mktemp("gpu-store"), 600, 256)
    with st.writer():
        compress_document(st, DOC, CompressRecipe(budget=None, keep=1.0, quant="int8"), label="b1-int8")
        compress_document(st, DOC, CompressRecipe(budget=None, keep=1.0, quant="int4"), label="b1-int4")
    yield st
    st.close()


def _ingested(lm, store_dir, n_tokens: int, chunk_tokens: int) -> Store:
    """A store holding the first ``n_tokens`` of the example manual, ingested by ``lm``."""
    tok = lm.tokenizer
    body = tok.decode(tok((EXAMPLES / DOC).read_text(), add_special_tokens=False).input_ids[:n_tokens])
    st = Store(store_dir)
    ingest_documents(st, lm, [Document(DOC, body, "test", hashlib.sha256(body.encode()).hexdigest())],
                     IngestOptions(chunk_tokens=chunk_tokens))
    return st


def _question(lm):
    return PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, "How long does charging take?")


def test_gpu_loaded_logits_equal_full_prefill(gpu_lm, gpu_store):
    ctx = load_document(gpu_lm, gpu_store, DOC)
    assert ctx.keys[0].is_cuda and ctx.keys[0].dtype == torch.float32
    q = _question(gpu_lm)
    cached, _ = forward_suffix(gpu_lm, ctx, q, last_only=True)
    full, _ = forward_suffix(gpu_lm, None, ctx.token_ids + q, last_only=True)
    diff = (cached[-1] - full[-1]).abs().max().item()
    assert diff <= 1e-4, diff
    a = generate(gpu_lm, load_document(gpu_lm, gpu_store, DOC), q, max_new_tokens=12)
    b = generate(gpu_lm, None, ctx.token_ids + q, max_new_tokens=12)
    assert a.token_ids == b.token_ids and a.token_ids


@pytest.mark.parametrize("label", ["b1-int8", "b1-int4"])
def test_gpu_dequantizes_on_device_like_the_cpu_reference(gpu_lm, gpu_store, label):
    """The Triton dequantizer fills the CUDA cache with what the CPU reference decoder gives
    (to fp32 rounding: the compiled kernel may fuse the multiply-add)."""
    prof = LoadProfile()
    fast = load_document(gpu_lm, gpu_store, DOC, label, workers=1, profile=prof)
    assert prof.dequantize > 0 and fast.keys[0].is_cuda
    bundles = [decode_bundle(gpu_store.read_object(c.object)) for c in gpu_store.get_version(DOC, label).chunks]
    for layer in (0, 17, 29):
        for role, got in ((0, fast.keys[layer]), (1, fast.values[layer])):
            want = torch.cat([layer_kv(b, layer)[role] for b in bundles], dim=1)
            torch.testing.assert_close(got[0].cpu(), want, rtol=1e-5, atol=1e-5)
    out = generate(gpu_lm, fast, _question(gpu_lm), max_new_tokens=8)
    assert out.token_ids


def test_gpu_fp16_model_answers_like_its_own_prefill(tmp_path):
    """fp16 on the GPU (load_model's default there): the stored path gives the full prefill's
    first tokens (fp16 rounding differs between a chunked and a one-shot prefill, so logits are
    compared loosely and the greedy answer exactly)."""
    from kdnctl.models.load import load_model

    lm = load_model(device="cuda", dtype="float16")
    st = _ingested(lm, tmp_path / "s", 400, 128)
    try:
        ctx = load_document(lm, st, DOC)
        assert ctx.keys[0].dtype == torch.float16
        q = _question(lm)
        a = generate(lm, ctx, q, max_new_tokens=6)
        b = generate(lm, None, ctx.token_ids + q, max_new_tokens=6)
        assert a.token_ids[:3] == b.token_ids[:3]
        assert (a.first_logits.float() - b.first_logits.float()).abs().max().item() < 0.5
    finally:
        st.close()


def test_gpu_load_still_checks_every_byte(gpu_lm, tmp_path):
    """Objects read into page-locked memory for the GPU are checked before use like any other."""
    from kdnctl.errors import StoreCorruptError

    st = _ingested(gpu_lm, tmp_path / "s", 300, 128)
    try:
        path = st.object_path(st.get_version(DOC).chunks[1].object)
        raw = bytearray(path.read_bytes())
        raw[len(raw) // 2] ^= 1
        path.chmod(0o644)
        path.write_bytes(bytes(raw))
        with pytest.raises(StoreCorruptError):
            load_document(gpu_lm, st, DOC)
    finally:
        st.close()


@pytest.mark.parametrize("budget", [0.25, 0.083])
def test_gpu_loads_size_budgeted_versions_like_the_cpu_decoder(gpu_lm, gpu_store, budget):
    """Size-budgeted (the auto recipes: ec, entropy-coded) versions made with the model on the GPU load onto it:
    the device decoder (host inflate, one kernel per role) writes K/V equal to the CPU decoder's
    (what bench/quality.py --device cuda evaluates)."""
    from kdnctl.quant import ec_device

    with gpu_store.writer():
        label = compress_document(gpu_store, DOC, CompressRecipe(budget=budget), lm=gpu_lm).label
    calls, real = [], ec_device.decode_into
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ec_device, "decode_into", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
        ctx = load_document(gpu_lm, gpu_store, DOC, label, workers=1)
    assert ctx.keys[0].is_cuda
    assert calls  # the device decoder wrote the cache
    bundles = [decode_bundle(gpu_store.read_object(c.object)) for c in gpu_store.get_version(DOC, label).chunks]
    for layer in (0, 29):
        for role, got in ((0, ctx.keys[layer]), (1, ctx.values[layer])):
            want = torch.cat([layer_kv(b, layer)[role] for b in bundles], dim=1)
            torch.testing.assert_close(got[0].cpu(), want, rtol=1e-5, atol=1e-5)
    assert generate(gpu_lm, ctx, _question(gpu_lm), max_new_tokens=8).token_ids
