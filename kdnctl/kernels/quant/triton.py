"""Triton kernels for groupwise KV quantization; same arguments and results as ``reference.py``
(read its docstring for layouts, formats and rounding rules).

Both layouts run through one strided kernel: the input is viewed as ``[A, N, B]`` with the
grouped axis N in the middle (keys/"channel": ``[H, T, D]`` as is; values/"token": the
``[H, D, T]`` transpose view), so no copy or layout-specific kernel is needed. One program owns
one group of one ``a`` for a block of BB lanes ``b``, and processes the group as even/odd
element pairs so that int4 packing (low nibble = even index) happens in registers.

Codes match the reference bit-exactly under the interpreter (same float32 ops, same order).
On a GPU, Triton's fast float32 division and FMA contraction may flip a code at an exact
rounding tie (error still <= scale/2 + ulp); floats agree within the test tolerance table.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import reference as ref

_FMT_ID = {"int8": 0, "int4": 1, "fp8": 2, "int3": 3, "int2": 4}
_LOWBIT = ("int3", "int2")


@triton.jit
def _f16_round_down(v):
    h = v.to(tl.float16)
    hf = h.to(tl.float32)
    bits = h.to(tl.int16, bitcast=True)
    step = tl.where(hf > 0, -1, 1)
    bits = tl.where(hf > v, bits + step, bits).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_round_up(v):
    h = v.to(tl.float16)
    bits = h.to(tl.int16, bitcast=True)
    bits = tl.where(h.to(tl.float32) < v, bits + 1, bits).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _round_e4m3(v):
    """Round float32 v in [-448, 448] to the nearest float8_e4m3fn value (ties to even).

    Done by hand so the final cast is exact: the interpreter's float32->fp8 cast loses the
    mantissa carry (-1.997 becomes -1.0, not -2.0). On a GPU this equals the hardware cvt.
    """
    a = tl.abs(v)
    e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)  # below 2**-6 e4m3 is subnormal with a fixed quantum of 2**-9
    quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    y = a / quantum  # exact: power-of-two division, |y| < 16
    r = tl.floor(y + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0
    r = tl.where(((r - y) == 0.5) & odd, r - 1.0, r)
    r = r * quantum
    neg = v.to(tl.int32, bitcast=True) < 0  # sign bit, so -0.0 and tiny negatives stay -0.0
    return tl.where(neg, -r, r)


@triton.jit
def _encode(x, scale, zero, FMT: tl.constexpr, QMAX: tl.constexpr):
    v = (x - zero) / scale
    if FMT == 2:
        v = _round_e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0))
        c = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        c = tl.minimum(tl.maximum(tl.floor(v + 0.5), 0.0), QMAX * 1.0).to(tl.uint8)
    return c


@triton.jit
def _decode(c, scale, zero, FMT: tl.constexpr):
    if FMT == 2:
        f = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        f = c.to(tl.float32)
    return f * scale + zero


@triton.jit
def _group_params(mn, mx, bm, s_ptr, z_ptr, s_off, FMT: tl.constexpr, QMAX: tl.constexpr, S_F16: tl.constexpr):
    """A group's (scale, zero) from its min and max, stored at ``s_off`` and returned; affine
    min/max for the integer formats, symmetric around the midpoint for fp8 (FMT 2)."""
    mn = tl.where(bm, mn, 0.0)  # dead lanes: keep the arithmetic finite
    mx = tl.where(bm, mx, 0.0)
    if FMT == 2:
        zero = (mn + mx) * 0.5
        if S_F16:
            zero = zero.to(tl.float16).to(tl.float32)
        scale = tl.maximum(mx - zero, zero - mn) / 448.0
    else:
        if S_F16:
            zero = _f16_round_down(mn)
        else:
            zero = mn
        scale = (mx - zero) / QMAX
    if S_F16:
        scale = _f16_round_up(scale)
    scale = tl.where(scale == 0, 1.0, scale)
    tl.store(s_ptr + s_off, scale, mask=bm)
    tl.store(z_ptr + s_off, zero, mask=bm)
    return scale, zero


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr,
    N, B, G,
    sxa, sxn, sxb, sqa, sqn, sqb, ssa, ssn, ssb,
    FMT: tl.constexpr, QMAX: tl.constexpr, S_F16: tl.constexpr,
    HALF: tl.constexpr, BB: tl.constexpr,
):
    a = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2) * BB + tl.arange(0, BB)
    bm = b < B
    i = tl.arange(0, HALF)
    le, lo = 2 * i, 2 * i + 1  # local (in-group) indices of the pair
    ne, no = g * G + le, g * G + lo  # global indices along N
    ve, vo = le < G, lo < G  # group members (incl. edge padding past N)
    # Edge padding: clamp to the last real element, exactly like the reference's torch.cat.
    x_base = x_ptr + a * sxa + b[None, :] * sxb
    me, mo = ve[:, None] & bm[None, :], vo[:, None] & bm[None, :]
    xe = tl.load(x_base + tl.minimum(ne, N - 1)[:, None] * sxn, mask=me, other=0.0).to(tl.float32)
    xo = tl.load(x_base + tl.minimum(no, N - 1)[:, None] * sxn, mask=mo, other=0.0).to(tl.float32)
    inf = float("inf")
    mn = tl.minimum(tl.min(tl.where(me, xe, inf), 0), tl.min(tl.where(mo, xo, inf), 0))
    mx = tl.maximum(tl.max(tl.where(me, xe, -inf), 0), tl.max(tl.where(mo, xo, -inf), 0))
    scale, zero = _group_params(mn, mx, bm, s_ptr, z_ptr, a * ssa + g * ssn + b * ssb, FMT, QMAX, S_F16)

    ce = _encode(xe, scale[None, :], zero[None, :], FMT, QMAX)
    co = _encode(xo, scale[None, :], zero[None, :], FMT, QMAX)
    q_base = q_ptr + a * sqa + b[None, :] * sqb
    if FMT == 1:
        # The high nibble of a final odd element's byte is padding: store 0 there.
        co = tl.where((no < N)[:, None], co, 0).to(tl.uint8)
        packed = (ce | (co << 4)).to(tl.uint8)
        p = g * (G // 2) + i  # byte index along N
        tl.store(q_base + p[:, None] * sqn, packed, mask=me & (ne < N)[:, None])
    else:
        tl.store(q_base + ne[:, None] * sqn, ce, mask=me & (ne < N)[:, None])
        tl.store(q_base + no[:, None] * sqn, co, mask=mo & (no < N)[:, None])


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, z_ptr, o_ptr,
    N, B, G,
    sqa, sqn, sqb, ssa, ssn, ssb, soa, son, sob,
    FMT: tl.constexpr, HALF: tl.constexpr, BB: tl.constexpr,
):
    a = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2) * BB + tl.arange(0, BB)
    bm = b < B
    i = tl.arange(0, HALF)
    le, lo = 2 * i, 2 * i + 1
    ne, no = g * G + le, g * G + lo
    me = ((le < G) & (ne < N))[:, None] & bm[None, :]  # real elements only: no padding out
    mo = ((lo < G) & (no < N))[:, None] & bm[None, :]
    s_off = a * ssa + g * ssn + b * ssb
    scale = tl.load(s_ptr + s_off, mask=bm, other=1.0).to(tl.float32)[None, :]
    zero = tl.load(z_ptr + s_off, mask=bm, other=0.0).to(tl.float32)[None, :]
    q_base = q_ptr + a * sqa + b[None, :] * sqb
    if FMT == 1:
        p = g * (G // 2) + i
        byte = tl.load(q_base + p[:, None] * sqn, mask=me, other=0)
        ce = byte & 0x0F
        co = byte >> 4
    else:
        ce = tl.load(q_base + ne[:, None] * sqn, mask=me, other=0)
        co = tl.load(q_base + no[:, None] * sqn, mask=mo, other=0)
    o_base = o_ptr + a * soa + b[None, :] * sob
    tl.store(o_base + ne[:, None] * son, _decode(ce, scale, zero, FMT), mask=me)
    tl.store(o_base + no[:, None] * son, _decode(co, scale, zero, FMT), mask=mo)


# ---- int3 / int2: eight codes per step ----------------------------------------------------
# A group (G divisible by 8) is processed as eight phases: phase j holds the elements with
# local index 8i + j. int2 byte 2i packs phases 0-3 and byte 2i+1 phases 4-7; int3 adds a
# high-bit plane after the ceil(N/4) low-plane bytes, byte i of the group = bit j of phase j.


@triton.jit
def _ld(x_base, g, G, N, i, J: tl.constexpr, bm, sxn):
    n = g * G + 8 * i + J
    m = (8 * i + J < G)[:, None] & bm[None, :]
    x = tl.load(x_base + tl.minimum(n, N - 1)[:, None] * sxn, mask=m, other=0.0).to(tl.float32)
    return x, m


@triton.jit
def _mn(x, m):
    return tl.min(tl.where(m, x, float("inf")), 0)


@triton.jit
def _mx(x, m):
    return tl.max(tl.where(m, x, -float("inf")), 0)


@triton.jit
def _code(x, scale, zero, g, G, N, i, J: tl.constexpr, QMAX: tl.constexpr):
    c = _encode(x, scale[None, :], zero[None, :], 0, QMAX)
    return tl.where((g * G + 8 * i + J < N)[:, None], c, 0).to(tl.uint8)


@triton.jit
def _quantize_lowbit_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr,
    N, NLOW, B, G,
    sxa, sxn, sxb, sqa, sqn, sqb, ssa, ssn, ssb,
    FMT: tl.constexpr, QMAX: tl.constexpr, S_F16: tl.constexpr,
    EIGHTH: tl.constexpr, BB: tl.constexpr,
):
    a = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2) * BB + tl.arange(0, BB)
    bm = b < B
    i = tl.arange(0, EIGHTH)
    x_base = x_ptr + a * sxa + b[None, :] * sxb
    x0, m0 = _ld(x_base, g, G, N, i, 0, bm, sxn)
    x1, m1 = _ld(x_base, g, G, N, i, 1, bm, sxn)
    x2, m2 = _ld(x_base, g, G, N, i, 2, bm, sxn)
    x3, m3 = _ld(x_base, g, G, N, i, 3, bm, sxn)
    x4, m4 = _ld(x_base, g, G, N, i, 4, bm, sxn)
    x5, m5 = _ld(x_base, g, G, N, i, 5, bm, sxn)
    x6, m6 = _ld(x_base, g, G, N, i, 6, bm, sxn)
    x7, m7 = _ld(x_base, g, G, N, i, 7, bm, sxn)
    mn = tl.minimum(tl.minimum(tl.minimum(_mn(x0, m0), _mn(x1, m1)), tl.minimum(_mn(x2, m2), _mn(x3, m3))),
                    tl.minimum(tl.minimum(_mn(x4, m4), _mn(x5, m5)), tl.minimum(_mn(x6, m6), _mn(x7, m7))))
    mx = tl.maximum(tl.maximum(tl.maximum(_mx(x0, m0), _mx(x1, m1)), tl.maximum(_mx(x2, m2), _mx(x3, m3))),
                    tl.maximum(tl.maximum(_mx(x4, m4), _mx(x5, m5)), tl.maximum(_mx(x6, m6), _mx(x7, m7))))
    scale, zero = _group_params(mn, mx, bm, s_ptr, z_ptr, a * ssa + g * ssn + b * ssb, FMT, QMAX, S_F16)
    c0 = _code(x0, scale, zero, g, G, N, i, 0, QMAX)
    c1 = _code(x1, scale, zero, g, G, N, i, 1, QMAX)
    c2 = _code(x2, scale, zero, g, G, N, i, 2, QMAX)
    c3 = _code(x3, scale, zero, g, G, N, i, 3, QMAX)
    c4 = _code(x4, scale, zero, g, G, N, i, 4, QMAX)
    c5 = _code(x5, scale, zero, g, G, N, i, 5, QMAX)
    c6 = _code(x6, scale, zero, g, G, N, i, 6, QMAX)
    c7 = _code(x7, scale, zero, g, G, N, i, 7, QMAX)
    lo0 = ((c0 & 3) | ((c1 & 3) << 2) | ((c2 & 3) << 4) | ((c3 & 3) << 6)).to(tl.uint8)
    lo1 = ((c4 & 3) | ((c5 & 3) << 2) | ((c6 & 3) << 4) | ((c7 & 3) << 6)).to(tl.uint8)
    start = g * G + 8 * i  # first element of this step
    live = (8 * i < G) & (start < N)
    q_base = q_ptr + a * sqa + b[None, :] * sqb
    p = g * (G // 4) + 2 * i
    tl.store(q_base + p[:, None] * sqn, lo0, mask=live[:, None] & bm[None, :])
    tl.store(q_base + (p + 1)[:, None] * sqn, lo1, mask=(live & (start + 4 < N))[:, None] & bm[None, :])
    if FMT == 3:
        hi = ((c0 >> 2) | ((c1 >> 2) << 1) | ((c2 >> 2) << 2) | ((c3 >> 2) << 3)
              | ((c4 >> 2) << 4) | ((c5 >> 2) << 5) | ((c6 >> 2) << 6) | ((c7 >> 2) << 7)).to(tl.uint8)
        ph = NLOW + g * (G // 8) + i
        tl.store(q_base + ph[:, None] * sqn, hi, mask=live[:, None] & bm[None, :])


@triton.jit
def _st(o_base, lo_byte, hi_byte, scale, zero, g, G, N, i, J: tl.constexpr, FMT: tl.constexpr, bm, son):
    c = (lo_byte >> (2 * (J % 4))) & 3
    if FMT == 3:
        c = c | (((hi_byte >> J) & 1) << 2)
    n = g * G + 8 * i + J
    m = ((8 * i + J < G) & (n < N))[:, None] & bm[None, :]
    tl.store(o_base + n[:, None] * son, c.to(tl.float32) * scale + zero, mask=m)


@triton.jit
def _dequantize_lowbit_kernel(
    q_ptr, s_ptr, z_ptr, o_ptr,
    N, NLOW, B, G,
    sqa, sqn, sqb, ssa, ssn, ssb, soa, son, sob,
    FMT: tl.constexpr, EIGHTH: tl.constexpr, BB: tl.constexpr,
):
    a = tl.program_id(0)
    g = tl.program_id(1)
    b = tl.program_id(2) * BB + tl.arange(0, BB)
    bm = b < B
    i = tl.arange(0, EIGHTH)
    s_off = a * ssa + g * ssn + b * ssb
    scale = tl.load(s_ptr + s_off, mask=bm, other=1.0).to(tl.float32)[None, :]
    zero = tl.load(z_ptr + s_off, mask=bm, other=0.0).to(tl.float32)[None, :]
    start = g * G + 8 * i
    live = (8 * i < G) & (start < N)
    q_base = q_ptr + a * sqa + b[None, :] * sqb
    p = g * (G // 4) + 2 * i
    b0 = tl.load(q_base + p[:, None] * sqn, mask=live[:, None] & bm[None, :], other=0)
    b1 = tl.load(q_base + (p + 1)[:, None] * sqn, mask=(live & (start + 4 < N))[:, None] & bm[None, :], other=0)
    if FMT == 3:
        ph = NLOW + g * (G // 8) + i
        hb = tl.load(q_base + ph[:, None] * sqn, mask=live[:, None] & bm[None, :], other=0)
    else:
        hb = b0
    o_base = o_ptr + a * soa + b[None, :] * sob
    _st(o_base, b0, hb, scale, zero, g, G, N, i, 0, FMT, bm, son)
    _st(o_base, b0, hb, scale, zero, g, G, N, i, 1, FMT, bm, son)
    _st(o_base, b0, hb, scale, zero, g, G, N, i, 2, FMT, bm, son)
    _st(o_base, b0, hb, scale, zero, g, G, N, i, 3, FMT, bm, son)
    _st(o_base, b1, hb, scale, zero, g, G, N, i, 4, FMT, bm, son)
    _st(o_base, b1, hb, scale, zero, g, G, N, i, 5, FMT, bm, son)
    _st(o_base, b1, hb, scale, zero, g, G, N, i, 6, FMT, bm, son)
    _st(o_base, b1, hb, scale, zero, g, G, N, i, 7, FMT, bm, son)


def _lowbit_blocks(group_size: int, lanes: int) -> tuple[int, int]:
    eighth = triton.next_power_of_2(max(1, group_size // 8))
    bb = min(triton.next_power_of_2(max(lanes, 1)), max(1, 512 // eighth), 64)
    return eighth, bb


def _view(t: torch.Tensor, layout: str) -> torch.Tensor:
    """[H, T, D]-shaped tensor as [A, N, B] with the grouped axis in the middle."""
    return t if layout == "channel" else t.transpose(1, 2)


def _blocks(group_size: int, lanes: int) -> tuple[int, int]:
    half = triton.next_power_of_2(max(1, (group_size + 1) // 2))
    # Keep a tile (2 * HALF * BB elements) around 4K so large groups don't blow registers.
    bb = min(triton.next_power_of_2(max(lanes, 1)), max(1, 2048 // half), 64)
    return half, bb


def quantize(
    x: torch.Tensor,
    fmt: str,
    group_size: int,
    layout: str,
    scale_dtype: torch.dtype = torch.float16,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`reference.quantize`. ``out`` = preallocated (q, scale, zero)."""
    ref.check_args(fmt, group_size, layout, scale_dtype)
    if x.dim() != 3 or not x.is_floating_point():
        raise ValueError(f"expected a float [H, T, D] tensor, got {tuple(x.shape)} {x.dtype}")
    q_shape, s_shape = ref.out_shapes(x.shape, fmt, group_size, layout)
    if out is None:
        q = torch.empty(q_shape, dtype=torch.uint8, device=x.device)
        s = torch.empty(s_shape, dtype=scale_dtype, device=x.device)
        z = torch.empty(s_shape, dtype=scale_dtype, device=x.device)
    else:
        q, s, z = out
        if tuple(q.shape) != q_shape or tuple(s.shape) != s_shape or tuple(z.shape) != s_shape:
            raise ValueError("out tensors have the wrong shapes")
        if q.dtype != torch.uint8 or s.dtype != scale_dtype or z.dtype != scale_dtype:
            raise ValueError("out tensors have the wrong dtypes")
    if x.numel() == 0:
        return q, s, z
    xv, qv, sv, zv = (_view(t, layout) for t in (x, q, s, z))
    if sv.stride() != zv.stride():
        raise ValueError("scale and zero outputs must share strides")
    a, n, b = xv.shape
    if fmt in _LOWBIT:
        eighth, bb = _lowbit_blocks(group_size, b)
        grid = (a, math.ceil(n / group_size), triton.cdiv(b, bb))
        _quantize_lowbit_kernel[grid](
            xv, qv, sv, zv, n, (n + 3) // 4, b, group_size,
            *xv.stride(), *qv.stride(), *sv.stride(),
            FMT=_FMT_ID[fmt], QMAX=ref.QMAX[fmt], S_F16=scale_dtype == torch.float16,
            EIGHTH=eighth, BB=bb,
        )
        return q, s, z
    half, bb = _blocks(group_size, b)
    grid = (a, math.ceil(n / group_size), triton.cdiv(b, bb))
    _quantize_kernel[grid](
        xv, qv, sv, zv, n, b, group_size,
        *xv.stride(), *qv.stride(), *sv.stride(),
        FMT=_FMT_ID[fmt], QMAX=ref.QMAX.get(fmt, 0), S_F16=scale_dtype == torch.float16,
        HALF=half, BB=bb,
    )
    return q, s, z


def dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    fmt: str,
    group_size: int,
    layout: str,
    shape: tuple[int, int, int],
    out_dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`reference.dequantize`. ``out`` = preallocated dense result."""
    ref.check_args(fmt, group_size, layout, scale.dtype)
    shape = tuple(int(v) for v in shape)
    q_shape, s_shape = ref.out_shapes(shape, fmt, group_size, layout)
    if tuple(q.shape) != q_shape or tuple(scale.shape) != s_shape or zero.shape != scale.shape:
        raise ValueError(
            f"quantized shapes q{tuple(q.shape)} scale{tuple(scale.shape)} do not match "
            f"{fmt}/{layout}/G={group_size} for {shape}: expected q{q_shape} scale{s_shape}"
        )
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=q.device)
    elif tuple(out.shape) != shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {shape}")
    if out.numel() == 0:
        return out
    qv, sv, zv, ov = (_view(t, layout) for t in (q, scale, zero, out))
    if sv.stride() != zv.stride():
        zv = _view(zero.contiguous(), layout)
        sv = _view(scale.contiguous(), layout)
    a, n, b = ov.shape
    if fmt in _LOWBIT:
        eighth, bb = _lowbit_blocks(group_size, b)
        grid = (a, math.ceil(n / group_size), triton.cdiv(b, bb))
        _dequantize_lowbit_kernel[grid](
            qv, sv, zv, ov, n, (n + 3) // 4, b, group_size,
            *qv.stride(), *sv.stride(), *ov.stride(),
            FMT=_FMT_ID[fmt], EIGHTH=eighth, BB=bb,
        )
        return out
    half, bb = _blocks(group_size, b)
    grid = (a, math.ceil(n / group_size), triton.cdiv(b, bb))
    _dequantize_kernel[grid](
        qv, sv, zv, ov, n, b, group_size,
        *qv.stride(), *sv.stride(), *ov.stride(),
        FMT=_FMT_ID[fmt], HALF=half, BB=bb,
    )
    return out
