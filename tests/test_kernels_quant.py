"""Triton quantization kernels (run by the interpreter on CPU) against the torch reference.

Codes must match bit-exactly; floats (scale, zero, dequantized values) within the ONE
tolerance table below, keyed by the input dtype. Every output is pre-filled with poison
(NaN for floats, the bitwise complement of the expected code for codes) so an element a kernel
forgets to write fails the comparison. bfloat16 is not covered: the interpreter lacks it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kdnctl.kernels import quant as kq  # noqa: E402
from kdnctl.kernels.quant import reference as ref  # noqa: E402
from kdnctl.kernels.quant import triton as tq  # noqa: E402  (TRITON_INTERPRET set in conftest)

# The one tolerance table: input dtype -> allclose kwargs for every float comparison. Under the
# interpreter results are bit-identical; the slack is for FMA contraction on a real GPU.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=1e-3, atol=1e-3),
}

# (shape, group_size): odd T, T=1, D not divisible by the group, a tiny tensor; group 6 is not
# a power of two, so the kernel's block has masked lanes beyond the group.
CASES = [
    ((3, 37, 64), 32),
    ((3, 37, 64), 64),
    ((3, 1, 64), 32),
    ((2, 37, 40), 32),
    ((2, 37, 40), 6),
    ((1, 5, 3), 6),
]
# int3/int2 need groups divisible by 8: 24 is not a power of two (masked lanes), 8 is the
# smallest, (1, 5, 3) leaves a group with fewer than one full byte of codes.
LOWBIT_CASES = [
    ((3, 37, 64), 32),
    ((3, 37, 64), 64),
    ((3, 1, 64), 32),
    ((2, 37, 40), 24),
    ((2, 37, 40), 8),
    ((1, 5, 3), 8),
    ((2, 45, 19), 16),
]
FMTS = ["int8", "int4", "int3", "int2", "fp8"]


def cases_for(fmt):
    return LOWBIT_CASES if fmt in ("int3", "int2") else CASES
LAYOUTS = ["channel", "token"]


def _data(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3 + 1
    x[..., :2] *= 10  # a couple of outlier channels, as keys have
    return x.to(dtype)


def _assert_close(a, b, dtype, what):
    assert not torch.isnan(a).any(), f"{what}: unwritten (NaN-poisoned) elements"
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def _poisoned_quant_outputs(expected, scale_dtype):
    q_ref, s_ref, _ = expected
    q = ~q_ref  # every byte differs from the expected code
    s = torch.full(s_ref.shape, float("nan"), dtype=scale_dtype)
    z = torch.full(s_ref.shape, float("nan"), dtype=scale_dtype)
    return q, s, z


@pytest.mark.parametrize(
    "dtype,scale_dtype",
    [
        (torch.float32, torch.float16),
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
    ],
)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_quantize_matches_reference(fmt, layout, dtype, scale_dtype):
    for i, (shape, g) in enumerate(cases_for(fmt)):
        x = _data(shape, dtype, seed=i)
        expected = ref.quantize(x, fmt, g, layout, scale_dtype)
        out = _poisoned_quant_outputs(expected, scale_dtype)
        q, s, z = tq.quantize(x, fmt, g, layout, scale_dtype, out=out)
        case = f"{fmt}/{layout}/{shape}/G{g}/{dtype}/{scale_dtype}"
        assert torch.equal(q, expected[0]), f"codes differ: {case}"
        _assert_close(s, expected[1], dtype, f"scale {case}")
        _assert_close(z, expected[2], dtype, f"zero {case}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_matches_reference(fmt, layout, dtype):
    for i, (shape, g) in enumerate(cases_for(fmt)):
        x = _data(shape, dtype, seed=10 + i)
        q, s, z = ref.quantize(x, fmt, g, layout)
        expected = ref.dequantize(q, s, z, fmt, g, layout, shape)
        out = torch.full(shape, float("nan"))
        got = tq.dequantize(q, s, z, fmt, g, layout, shape, out=out)
        assert got is out
        _assert_close(got, expected, dtype, f"dequant {fmt}/{layout}/{shape}/G{g}")


def test_noncontiguous_input():
    x = _data((3, 64, 37), torch.float32).transpose(1, 2)  # [3, 37, 64] view, not contiguous
    for fmt in FMTS:
        for layout in LAYOUTS:
            a = ref.quantize(x, fmt, 32, layout)
            b = tq.quantize(x, fmt, 32, layout)
            assert all(torch.equal(u, v) for u, v in zip(a, b)), (fmt, layout)


def test_empty_tensor():
    x = torch.zeros(3, 0, 64)
    q, s, z = tq.quantize(x, "int4", 32, "channel")
    assert q.shape == (3, 0, 64) and s.shape == (3, 0, 64)
    assert tq.dequantize(q, s, z, "int4", 32, "channel", (3, 0, 64)).shape == (3, 0, 64)


@pytest.mark.parametrize("fmt,bits", [("int3", 3), ("int2", 2)])
def test_lowbit_packing_is_exact(fmt, bits):
    """Known codes survive pack/unpack, the stored size is exactly ``bits`` per code (rounded
    up per plane), and every element is within scale/2 of its input."""
    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 2**bits, (2, 3, 45), generator=g, dtype=torch.uint8)
    packed = ref.pack_codes(codes, fmt)
    assert packed.shape[-1] == ref.packed_len(45, fmt) == ((45 + 3) // 4 + (45 + 7) // 8 if bits == 3 else 12)
    assert torch.equal(ref.unpack_codes(packed, 45, fmt), codes)
    x = _data((3, 45, 19), torch.float32, seed=3)
    for layout in LAYOUTS:
        q, s, z = tq.quantize(x, fmt, 16, layout)
        y = tq.dequantize(q, s, z, fmt, 16, layout, x.shape)
        step = ref.dequantize(q, s, z, fmt, 16, layout, x.shape) - y
        assert float(step.abs().max()) <= 1e-5
        bound = s.float().max() / 2 + 1e-4
        assert float((x - y).abs().max()) <= float(bound)


def test_fp8_rounding_at_every_midpoint():
    """The kernel's hand-rolled e4m3 rounding equals torch's cast on all grid points, the exact
    midpoints between them (ties to even) and values just beside them."""
    import triton
    import triton.language as tl

    @triton.jit
    def _k(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + i, mask=i < n)
        c = tq._round_e4m3(v).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(o_ptr + i, c, mask=i < n)

    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()  # sorted, includes 0 and +-448
    mids = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([grid, mids, torch.nextafter(mids, grid[1:]), torch.nextafter(mids, grid[:-1])])
    x = torch.cat([x, torch.tensor([1e-30, -1e-30, -0.0])])
    out = torch.full(x.shape, 0xFF, dtype=torch.uint8)
    _k[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256)
    expected = x.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (out != expected).nonzero().flatten()
    assert bad.numel() == 0, f"fp8 rounding differs at {x[bad][:5].tolist()}"


def test_dispatch_routes_to_triton(monkeypatch):
    x = _data((3, 37, 64), torch.float32)
    calls = []
    real = tq.quantize

    def spy(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(tq, "quantize", spy)
    monkeypatch.delenv("KDNCTL_FORCE_TRITON", raising=False)
    kq.quantize(x, "int8", 32, "channel")
    assert calls == []  # CPU tensors use the reference by default
    monkeypatch.setenv("KDNCTL_FORCE_TRITON", "1")
    got = kq.quantize(x, "int4", 32, "channel")
    assert calls == ["int4"]
    assert all(torch.equal(a, b) for a, b in zip(got, ref.quantize(x, "int4", 32, "channel")))
    monkeypatch.setenv("KDNCTL_DISABLE_TRITON", "1")
    kq.quantize(x, "int4", 32, "channel")
    assert calls == ["int4"]


def test_comparison_is_sensitive():
    """The harness catches a kernel that skips elements or gets a scale wrong."""
    x = _data((3, 37, 64), torch.float32)
    q, s, z = ref.quantize(x, "int8", 32, "token")
    out = torch.full(x.shape, float("nan"))
    got = tq.dequantize(q, s, z, "int8", 32, "token", x.shape, out=out)
    expected = ref.dequantize(q, s, z, "int8", 32, "token", x.shape)
    broken = got.clone()
    broken[0, 0, -1] = float("nan")  # one unwritten element
    with pytest.raises(AssertionError):
        _assert_close(broken, expected, torch.float32, "poison")
    wrong = tq.dequantize(q, s * 1.01, z, "int8", 32, "token", x.shape)
    with pytest.raises(AssertionError):
        _assert_close(wrong, expected, torch.float32, "scale")


def test_bad_arguments():
    x = torch.randn(2, 8, 8)
    with pytest.raises(ValueError):
        tq.quantize(x, "int4", 5, "channel")  # int4 needs an even group
    with pytest.raises(ValueError):
        tq.quantize(x, "int5", 4, "channel")
    with pytest.raises(ValueError):
        tq.quantize(x, "int3", 4, "channel")  # int3/int2 need groups divisible by 8
    with pytest.raises(ValueError):
        tq.quantize(x, "int2", 12, "token")
    with pytest.raises(ValueError):
        tq.quantize(x, "int8", 4, "rows")
    q, s, z = ref.quantize(x, "int8", 4, "channel")
    with pytest.raises(ValueError):
        tq.dequantize(q, s, z, "int8", 4, "channel", (2, 9, 8))


@pytest.mark.parametrize("scheme", ["int8", "int4", "int3", "int2", "fp8", "mixed"])
def test_quantizers_identical_through_triton(scheme, monkeypatch):
    """kdnctl.quant produces the same tensors and dense results on the Triton path."""
    from kdnctl.quant import dequantize_tensors, get_quantizer

    g = torch.Generator().manual_seed(4)
    keys, values = torch.randn(3, 37, 64, generator=g), torch.randn(3, 37, 64, generator=g)
    q = get_quantizer(scheme, group_size=32)
    monkeypatch.delenv("KDNCTL_FORCE_TRITON", raising=False)
    t_ref, meta = q.quantize_layer(keys, values)
    monkeypatch.setenv("KDNCTL_FORCE_TRITON", "1")
    t_tr, _ = q.quantize_layer(keys, values)
    assert t_ref.keys() == t_tr.keys()
    for name in t_ref:
        if t_ref[name].is_floating_point():
            _assert_close(t_tr[name], t_ref[name], torch.float32, name)
        else:
            assert torch.equal(t_tr[name], t_ref[name]), name
    k_tr = dequantize_tensors(t_tr, "keys", meta)
    monkeypatch.delenv("KDNCTL_FORCE_TRITON")
    _assert_close(k_tr, dequantize_tensors(t_ref, "keys", meta), torch.float32, "keys")
