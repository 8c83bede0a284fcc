"""An ec version loaded into a cache the compiled decoder does not write directly (a GPU's, or a
CPU cache in float16 or bfloat16): the whole version decoded by the compiled batch decoder into
float32 host memory, then copied, cast, into the cache (``kdnctl.engine.dequant.ec_staged_into``).
The K/V equal the reference decoder's, cast alike; a corrupt frame ends the load in
BundleFormatError."""

from __future__ import annotations

import pytest
import torch

from kdnctl.errors import BundleFormatError
from kdnctl.quant import ec_batch

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not ec_batch.enabled(), reason="numba or ISA-L missing: loads take the reference path")]


@pytest.fixture(scope="module")
def bundles(lm, tmp_path_factory):
    from budgetkit import trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.format.bundle import decode_bundle

    st = trimmed_store(tmp_path_factory, lm, {"faq.md": 300})
    with st.writer():
        compress_document(st, "faq.md", CompressRecipe(budget=0.25), lm=lm)
    return [decode_bundle(st.read_object(c.object)) for c in st.get_version("faq.md", "b0.25").chunks]


@pytest.fixture(scope="module", params=["bfloat16", "float16"])
def half_lm(request):
    from kdnctl.models.load import load_model

    return load_model(dtype=request.param)


def _spy(monkeypatch) -> list:
    calls = []
    real = ec_batch.decode_into

    def spy(out, *a, **k):
        calls.append((out[0].dtype, out[0].device.type))
        return real(out, *a, **k)

    monkeypatch.setattr(ec_batch, "decode_into", spy)
    return calls


def test_a_half_precision_cache_is_decoded_in_one_batch_as_the_reference_decodes_it(half_lm, lm, bundles, monkeypatch):
    from kdnctl.engine.hf import LoadProfile, context_from_bundles

    with torch.inference_mode():
        direct = context_from_bundles(lm, bundles)  # a float32 CPU cache: decoded in place
    calls = _spy(monkeypatch)
    prof = LoadProfile()
    with torch.inference_mode():
        staged = context_from_bundles(half_lm, bundles, profile=prof, overlap=True)
    assert calls == [(torch.float32, "cpu")]  # one batch decode of the whole version, in float32 host memory
    assert staged.pending is None and prof.dequantize > 0
    assert staged.keys[0].dtype == half_lm.dtype
    for got, want in zip(staged.keys + staged.values, direct.keys + direct.values):
        assert torch.equal(got, want.to(half_lm.dtype))  # the batch decoder's float32 results, cast once
    monkeypatch.setenv("KDNCTL_EC_REFERENCE", "1")
    with torch.inference_mode():
        ref = context_from_bundles(half_lm, bundles)
        ref32 = context_from_bundles(lm, bundles)
    assert len(calls) == 1  # (the reference path)
    for got, want in zip(staged.values, ref.values):
        assert torch.equal(got, want)
    eps = torch.finfo(half_lm.dtype).eps
    for got, want, want32 in zip(staged.keys, ref.keys, ref32.keys):
        # the key basis's matmul sums in another order (within 1e-5 of the largest key in
        # float32, tests/test_ec_batch.py): then one rounding to the half-precision type
        bound = 0.5 * eps * want32.abs() + 2e-5 * want32.abs().max()
        assert ((got.float() - want32).abs() <= bound).all()
        assert (got != want).float().mean() < 0.01


def test_a_corrupt_frame_ends_a_staged_load_in_the_stores_error(half_lm, bundles):
    from kdnctl.engine.hf import context_from_bundles
    from kdnctl.format.bundle import KVBundle

    last = bundles[0].n_layers - 1
    tensors = dict(bundles[1].tensors)
    blob = tensors[f"layers.{last}.values.codes"].clone()
    blob[1] = 0  # no frames: its bins need some
    tensors[f"layers.{last}.values.codes"] = blob
    bad = [bundles[0], KVBundle(meta=bundles[1].meta, tensors=tensors), *bundles[2:]]
    with torch.inference_mode(), pytest.raises(BundleFormatError, match=f"layers.{last}.values"):
        context_from_bundles(half_lm, bad)


def test_a_float32_cpu_cache_still_decodes_in_place(lm, bundles, monkeypatch):
    from kdnctl.engine.hf import context_from_bundles

    calls = _spy(monkeypatch)
    with torch.inference_mode():
        ctx = context_from_bundles(lm, bundles)
    assert len(calls) == 1 and ctx.keys[0].dtype == torch.float32
    # straight into the cache: the decoder's output is the cache itself, not a staging copy
    assert calls[0] == (torch.float32, "cpu")
