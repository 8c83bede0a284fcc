"""ec's device decoder (``kdnctl.quant.ec_device``: host inflate, then ``kdnctl.kernels.ec_rows``
per role) against the reference decoder, layer by layer: every code width and digit packing,
odd sizes, levels, RoPE by the chunk's or each layer's positions, the key basis, a half-precision
cache; the Triton kernel (the interpreter on CPU, CUDA where present) against its torch
reference; fuzzed frames refused on the host exactly where the reference refuses them."""

from __future__ import annotations

import random

import pytest
import torch

from kdnctl.quant import ec_batch, ec_device

from test_ec_batch import (Chunk, _chunk, _reference, every_packing_chunk, fuzz_against_the_reference,  # noqa: F401
                           with_basis)  # (a fixture)

pytestmark = pytest.mark.skipif(not ec_batch.enabled(), reason="numba or ISA-L missing: loads take the reference path")

# The one tolerance table: the cache's dtype -> how far a decoded element may lie from the
# reference's, relative to the role's largest value (a matmul's sums in another order, FMA
# contraction on a GPU, the cast of the result)
TOL = {torch.float32: 1e-5, torch.float16: 1e-3}


def _device(chunks, n_layers, h, d, *, dtype=torch.float32, device="cpu", room=3, workers=2):
    total = sum(c.layer_len(0) for c in chunks)
    out = tuple(torch.full((n_layers, h, total + room, d), float("nan"), dtype=dtype, device=device) for _ in range(2))
    starts = [sum(c.layer_len(0) for c in chunks[:i]) for i in range(len(chunks))]
    assert ec_device.eligible(chunks, n_layers, chunks[0].meta["quant"], out)
    ec_device.decode_into(out, chunks, starts, chunks[0].meta["quant"], workers=workers)
    assert all(o[:, :, total:].isnan().all() for o in out)  # nothing written past the chunks
    return [o[:, :, :total].cpu() for o in out]


def _close(ref, got, dtype=torch.float32):
    for a, b in zip(ref, got):
        assert b.dtype == dtype and not b.isnan().any()
        assert (a - b.float()).abs().max() <= TOL[dtype] * max(1.0, float(a.abs().max()))


@pytest.fixture(params=["reference", "triton"])
def kernel(request, monkeypatch):
    """The device half as the torch reference, or as the Triton kernel under the interpreter."""
    if request.param == "triton":
        pytest.importorskip("triton")
        monkeypatch.setenv("KDNCTL_FORCE_TRITON", "1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


CASES = [  # (heads, tokens, head dim, RoPE theta, own positions per layer and head, own widths)
    (3, 37, 16, 10000.0, False, True), (1, 1, 8, 10000.0, False, True), (2, 29, 10, None, False, True),
    (3, 40, 16, 500.0, True, True), (2, 0, 8, 10000.0, False, True), (3, 37, 16, 10000.0, False, False),
    (2, 21, 10, None, True, False)]


@pytest.mark.parametrize("h,t,d,theta,own,own_widths", CASES)
def test_device_decoder_equals_the_reference(kernel, h, t, d, theta, own, own_widths):
    n_layers = 3
    chunks = [_chunk(11 + j, h, t + j, d, n_layers, theta=theta, own_positions=own, start=j * 300, own_widths=own_widths)
              for j in range(3)]
    ref = _reference(chunks, n_layers, h, d)
    got = _device(chunks, n_layers, h, d)
    if kernel == "reference":
        for a, b in zip(ref, got):
            assert torch.equal(a, b)  # the same float32 operations in the same order: bit for bit
    else:
        _close(ref, got)


def test_every_packing_reaches_the_kernel(kernel):
    c = every_packing_chunk()
    _close(_reference([c], 2, 3, 32), _device([c], 2, 3, 32))


def test_key_basis(kernel, with_basis):  # noqa: F811
    h, d, n_layers = 3, 24, 3
    chunks = [_chunk(21 + j, h, 50 - 7 * j, d, n_layers, basis=with_basis, start=50 * j) for j in range(3)]
    ref = _reference(chunks, n_layers, h, d)
    got = _device(chunks, n_layers, h, d)
    assert torch.equal(ref[1], got[1])
    _close(ref, got)


def test_a_half_precision_cache(kernel):
    h, d, n_layers = 2, 16, 2
    chunks = [_chunk(51 + j, h, 33, d, n_layers, start=33 * j, own_levels=True) for j in range(2)]
    ref = _reference(chunks, n_layers, h, d)
    _close(ref, _device(chunks, n_layers, h, d, dtype=torch.float16), torch.float16)


@pytest.mark.parametrize("h,t,d", [(3, 37, 16), (2, 29, 10), (1, 1, 8)])
def test_the_kernel_equals_its_reference(h, t, d):
    """The Triton kernel (interpreter) and the torch reference of ``kdnctl.kernels.ec_rows`` on the
    same inputs, with and without a key basis; the cache is pre-filled with NaN, so an element
    either forgets to write fails."""
    pytest.importorskip("triton")
    from kdnctl.kernels.ec_rows import reference as rr
    from kdnctl.kernels.ec_rows import triton as tr

    g = torch.Generator().manual_seed(t * 100 + d)
    n_layers, hd = 2, h * d
    chunks = [_chunk(61 + j, h, t + j, d, n_layers, start=40 * j) for j in range(2)]
    captured = []
    real = rr.decode_rows
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("kdnctl.kernels.ec_rows.reference.decode_rows", lambda *a: (captured.append(a), real(*a))[1])
        _device(chunks, n_layers, h, d)
    assert len(captured) == 2
    basis = torch.linalg.qr(torch.randn(n_layers, h, d, d, generator=g))[0].transpose(-1, -2).contiguous()
    for args in captured:
        for b in (None, basis):
            want = torch.full_like(args[-1], float("nan"))
            got = torch.full_like(args[-1], float("nan"))
            rr.decode_rows(*args[:10], b, want)
            tr.decode_rows(*args[:10], b, got)
            assert torch.equal(want.isnan(), got.isnan())
            m = ~want.isnan()
            assert (want[m] - got[m]).abs().max() <= TOL[torch.float32] * max(1.0, float(want[m].abs().max()))
            assert hd == args[3].shape[1]


@pytest.mark.parametrize("seed", range(3))
def test_fuzzed_frames_are_refused_where_the_reference_refuses_them(seed):
    """Flips, overwrites, truncations, insertions and rewritten header bytes of codes and params
    blobs: the device decoder raises BundleFormatError exactly where the reference does, before
    anything is launched, and where the reference decodes, both give the same K/V."""
    h, t, d, n_layers = 2, 23, 8, 2
    rng = random.Random(20261202 + seed)
    base = _chunk(31 + seed, h, t, d, n_layers)
    counts = fuzz_against_the_reference(base, n_layers, h, d, rng, 120,
                                        lambda chunk: _device([chunk], n_layers, h, d, workers=1))
    assert counts["error"] > 40, counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_decoder_equals_the_cpu_reference(dtype, with_basis):  # noqa: F811
    """On a GPU: codes exact (values of a basis-free role within float rounding of the CPU's),
    floats within the tolerance table (bfloat16: its own rounding)."""
    h, d, n_layers = 3, 24, 3
    chunks = [_chunk(71 + j, h, 40 + 9 * j, d, n_layers, basis=with_basis, start=60 * j) for j in range(3)]
    ref = _reference(chunks, n_layers, h, d)
    got = _device(chunks, n_layers, h, d, dtype=dtype, device="cuda")
    tol = TOL.get(dtype, 1e-2)
    for a, b in zip(ref, got):
        assert (a - b.float()).abs().max() <= tol * max(1.0, float(a.abs().max()))


def test_the_loader_takes_the_device_decoder_for_a_cache_the_batch_decoder_does_not_write(monkeypatch):
    """A half-precision cache (a GPU's, or here a CPU's with the kernel run by the interpreter)
    goes through ``ec_device_into``; with Triton turned off, through the staged path; both equal
    the reference."""
    pytest.importorskip("triton")
    from kdnctl.engine.dequant import ec_device_into, ec_staged_into

    h, d, n_layers = 2, 16, 3

    class Coded(Chunk):  # what the loader asks of a bundle besides the chunk's tensors
        def is_quantized(self, i: int) -> bool:
            return True

    chunks = [Coded(c.tensors, c.meta) for c in (_chunk(81 + j, h, 20 + j, d, n_layers, start=30 * j) for j in range(2))]
    ref = _reference(chunks, n_layers, h, d)
    starts = [0, chunks[0].layer_len(0)]
    offsets = [[s] * n_layers for s in starts]
    lens = [[c.layer_len(0)] * n_layers for c in chunks]
    total = starts[1] + lens[1][0]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for force, into in (("1", ec_device_into), ("0", ec_staged_into)):
        monkeypatch.setenv("KDNCTL_FORCE_TRITON", force)
        stacked = tuple(torch.full((n_layers, h, total, d), float("nan"), dtype=torch.float16) for _ in range(2))
        assert ec_device_into(chunks, n_layers, stacked, offsets, lens) == (force == "1")
        if force == "0":
            assert into(chunks, n_layers, stacked, offsets, lens)
        _close(ref, stacked, torch.float16)
