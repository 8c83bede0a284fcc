"""On real hardware: every Triton kernel compiled for the GPU against its torch reference on CPU.

The interpreter tests (test_kernels_quant.py, test_kernels_kvcrush.py) prove the kernels' logic
on CPU; these run the same cases, with the same tolerance tables (imported, not copied), through
the public dispatch (CUDA tensors go to Triton) on a CUDA device. Skipped without CUDA: the
lead runs them on the lent GPU machine (bench/gpu.sh) and reports them in the README.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import test_kernels_kvcrush as kt  # noqa: E402  (same cases and tolerance tables)
import test_kernels_quant as qt  # noqa: E402

from kdnctl.kernels import kvcrush as kk  # noqa: E402
from kdnctl.kernels import quant as kq  # noqa: E402
from kdnctl.kernels.dispatch import use_triton  # noqa: E402
from kdnctl.kernels.kvcrush import reference as kref  # noqa: E402
from kdnctl.kernels.quant import reference as qref  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _unpacked(q, fmt, shape, g, layout):
    """Codes of a packed low-bit tensor, one per element (via the reference dequantizer with
    scale 1 and zero 0, which returns the code itself)."""
    n_groups = qref.quantize(torch.zeros(shape), fmt, g, layout)[1].shape
    ones, zeros = torch.ones(n_groups, dtype=torch.float16), torch.zeros(n_groups, dtype=torch.float16)
    return qref.dequantize(q, ones, zeros, fmt, g, layout, shape).round().to(torch.int16)


def test_dispatch_sends_cuda_tensors_to_triton():
    assert use_triton(torch.zeros(1, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", qt.LAYOUTS)
@pytest.mark.parametrize("fmt", qt.FMTS)
def test_quantize_on_gpu_matches_reference(fmt, layout, dtype):
    for i, (shape, g) in enumerate(qt.cases_for(fmt)):
        x = qt._data(shape, dtype, seed=i)
        want = qref.quantize(x, fmt, g, layout, torch.float16)
        q, s, z = kq.quantize(x.cuda(), fmt, g, layout, torch.float16)
        case = f"cuda {fmt}/{layout}/{shape}/G{g}/{dtype}"
        assert q.is_cuda
        # Codes: the compiled kernel contracts multiply-adds (and divides) differently from the
        # CPU reference, so a value sitting on a rounding boundary can land one code away (seen
        # on an H100: 1-2 codes of 1.5k-7k in 9 of 30 cases). Allow exactly that: one step, at
        # under 0.2% of the codes; a wrong group, shift or packing moves far more, by more.
        off = (q.cpu().to(torch.int16) - want[0].to(torch.int16)).abs()
        if fmt in ("int4", "int3", "int2"):  # packed: compare the unpacked codes instead
            off = (_unpacked(q.cpu(), fmt, shape, g, layout) - _unpacked(want[0], fmt, shape, g, layout)).abs()
        n_off = int((off > 0).sum())
        assert int(off.max()) <= 1 and n_off <= 0.002 * off.numel(), f"codes differ at {n_off} of {off.numel()}: {case}"
        # scale and zero are stored as float16: their row of the table, whatever the input
        qt._assert_close(s.cpu(), want[1], torch.float16, f"scale {case}")
        qt._assert_close(z.cpu(), want[2], torch.float16, f"zero {case}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", qt.LAYOUTS)
@pytest.mark.parametrize("fmt", qt.FMTS)
def test_dequantize_on_gpu_matches_reference(fmt, layout, dtype):
    for i, (shape, g) in enumerate(qt.cases_for(fmt)):
        x = qt._data(shape, dtype, seed=10 + i)
        q, s, z = qref.quantize(x, fmt, g, layout)
        want = qref.dequantize(q, s, z, fmt, g, layout, shape)
        got = kq.dequantize(q.cuda(), s.cuda(), z.cuda(), fmt, g, layout, shape)
        assert got.is_cuda and got.shape == shape
        qt._assert_close(got.cpu(), want, dtype, f"cuda dequant {fmt}/{layout}/{shape}/G{g}")


@pytest.mark.parametrize("shape,seed", [((1, 1, 1), 0), ((3, 5, 131), 1), ((30, 3, 4099), 3)])
def test_binarize_on_gpu_matches_reference(shape, seed):
    from kdnctl.kernels.kvcrush import triton as tri

    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(shape, generator=gen)
    thr = scores.median(dim=-1).values
    scores.view(-1)[::7] = float("nan")
    out = kt.poisoned(shape, torch.uint8).cuda()
    tri.binarize(scores.cuda(), thr.cuda(), out)
    kt.assert_close("binarize", out.cpu(), kref.binarize(scores, thr))


@pytest.mark.parametrize("groups,n,n_bits,seed", [(1, 1, 1, 0), (30, 129, 3, 1), (3, 4099, 90, 2)])
def test_hamming_on_gpu_matches_reference(groups, n, n_bits, seed):
    from kdnctl.kernels.kvcrush import triton as tri

    gen = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 2, (groups, n, n_bits), generator=gen, dtype=torch.uint8)
    anchor_bits = torch.randint(0, 2, (groups, n_bits), generator=gen, dtype=torch.uint8)
    words, anchor = kref.pack_bits(bits), kref.pack_bits(anchor_bits)
    out = kt.poisoned((groups, n), torch.int32).cuda()
    tri.hamming(words.cuda(), anchor.cuda(), out)
    kt.assert_close("hamming", out.cpu(), kref.hamming(words, anchor))


@pytest.mark.parametrize("shape,k,dtype", [((3, 2, 50, 37), 19, torch.float32), ((30, 3, 4099, 64), 1025, torch.float16)])
def test_gather_on_gpu_matches_reference(shape, k, dtype):
    from kdnctl.kernels.kvcrush import triton as tri

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=gen).to(dtype)
    l, h, t, d = shape
    idx = torch.sort(torch.rand(l, h, t, generator=gen).argsort(-1)[..., :k], dim=-1).values
    out = kt.poisoned((l, h, k, d), dtype).cuda()
    tri.gather_kept(x.cuda(), idx.cuda(), out)
    kt.assert_close(f"gather.{str(dtype).split('.')[-1]}", out.cpu(), kref.gather_kept(x, idx))


def test_public_kvcrush_entry_points_agree_on_gpu():
    """The dispatching functions the press calls give the CPU reference's answer on CUDA."""
    gen = torch.Generator().manual_seed(11)
    scores = torch.randn(30, 3, 777, generator=gen)
    thr = scores.median(dim=-1).values
    got = kk.binarize(scores.cuda(), thr.cuda()).cpu()
    assert torch.equal(got, kref.binarize(scores, thr))
