"""The Triton kernel of ``reference.py`` (its docstring has the layouts): one program per (blob,
head, block of ``BT`` tokens), every launch a whole role of a version.

A program reads its channels' codes as two ``[BT, HALF]`` tiles, the first and second half of
the head (RoPE pairs channel ``i`` with ``i + D/2``), so that the rotation needs no shuffle; in a
key basis each half of the output is two ``tl.dot`` of those tiles with quarters of the
step-scaled basis, at IEEE float32 precision (not TF32). Codes are exact; floats differ from the
reference by the order of the basis's sums and FMA contraction on a GPU (the tests' tolerance).
"""

from __future__ import annotations

import triton
import triton.language as tl

BT = 32  # tokens per program


@triton.jit
def _codes(u_ptr, off_ptr, first_ptr, mode_ptr, ch, cm, j, jm):
    """float32 ``[BT, C]``: the codes of channels ``ch`` (``cm``: real ones) at tokens ``j``."""
    mode = tl.load(mode_ptr + ch, mask=cm, other=0)
    per, fw, peak = mode & 15, (mode >> 4) & 15, mode >> 8
    off = tl.load(off_ptr + ch, mask=cm, other=0)
    first = tl.load(first_ptr + ch, mask=cm, other=0)
    i = first[None, :] + j[:, None]  # int64: the code's index in its frame
    m = jm[:, None] & cm[None, :] & (per[None, :] > 0)
    one = per[None, :] == 1
    two = one & (fw[None, :] == 2)
    per_s = tl.maximum(per, 1)[None, :].to(tl.int64)
    a = off[None, :] + tl.where(one, i * fw[None, :], i // per_s)
    b0 = tl.load(u_ptr + a, mask=m, other=0).to(tl.int32)
    b1 = tl.load(u_ptr + a + 1, mask=m & two, other=0).to(tl.int32)
    v8 = tl.where(b0 >= 128, b0 - 256, b0)
    w = b0 | (b1 << 8)
    v16 = tl.where(w >= 32768, w - 65536, w)
    radix = 2 * peak[None, :] + 1
    k = (i % per_s).to(tl.int32)
    q = b0
    for e in tl.static_range(4):  # digit k of the byte: at most 5 digits to a byte (radix 3)
        q = tl.where(k > e, q // radix, q)
    vp = q % radix - peak[None, :]
    v = tl.where(one, tl.where(two, v16, v8), vp)
    return tl.where(m, v, 0).to(tl.float32)


@triton.jit
def _quarter(bt_ptr, r, rm, c, cm, D):
    return tl.load(bt_ptr + r[:, None] * D + c[None, :], mask=rm[:, None] & cm[None, :], other=0.0)


@triton.jit
def _rows_kernel(u_ptr, blob_ptr, off_ptr, first_ptr, mode_ptr, step_ptr, mean_ptr, lsc_ptr, cos_ptr, sin_ptr,
                 basis_ptr, out_ptr, s_l, s_h, s_t, H, D, HALF,
                 HAS_BASIS: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr):
    pid = tl.program_id(0)
    b = pid // H
    h = pid % H
    row = blob_ptr + b * 6
    layer = tl.load(row)
    tok = tl.load(row + 1)
    t = tl.load(row + 2)
    lsc_off = tl.load(row + 3)
    cs_row = tl.load(row + 4)
    cs_heads = tl.load(row + 5)
    j = tl.program_id(1) * BT + tl.arange(0, BT)
    jm = j < t
    c = tl.arange(0, HP)
    lo_m = c < HALF
    hi_m = c < D - HALF
    base = b * H * D + h * D
    sc = tl.load(lsc_ptr + lsc_off + j, mask=jm, other=0.0)[:, None]
    z_lo = _codes(u_ptr, off_ptr, first_ptr, mode_ptr, base + c, lo_m, j, jm) * sc
    z_hi = _codes(u_ptr, off_ptr, first_ptr, mode_ptr, base + HALF + c, hi_m, j, jm) * sc
    st_lo = tl.load(step_ptr + base + c, mask=lo_m, other=0.0)[None, :]
    st_hi = tl.load(step_ptr + base + HALF + c, mask=hi_m, other=0.0)[None, :]
    mu_lo = tl.load(mean_ptr + base + c, mask=lo_m, other=0.0)[None, :]
    mu_hi = tl.load(mean_ptr + base + HALF + c, mask=hi_m, other=0.0)[None, :]
    if HAS_BASIS:
        bt = basis_ptr + (layer * H + h) * D * D
        y_lo = tl.dot(z_lo, _quarter(bt, c, lo_m, c, lo_m, D) * st_lo, input_precision="ieee")
        y_lo = tl.dot(z_hi, _quarter(bt, HALF + c, hi_m, c, lo_m, D) * st_lo, y_lo, input_precision="ieee") + mu_lo
        y_hi = tl.dot(z_lo, _quarter(bt, c, lo_m, HALF + c, hi_m, D) * st_hi, input_precision="ieee")
        y_hi = tl.dot(z_hi, _quarter(bt, HALF + c, hi_m, HALF + c, hi_m, D) * st_hi, y_hi, input_precision="ieee") + mu_hi
    else:
        y_lo = z_lo * st_lo + mu_lo
        y_hi = z_hi * st_hi + mu_hi
    if cs_row >= 0:
        r = cs_row + h * cs_heads + j
        cm = jm[:, None] & lo_m[None, :]
        c_lo = tl.load(cos_ptr + r[:, None] * D + c[None, :], mask=cm, other=0.0)
        c_hi = tl.load(cos_ptr + r[:, None] * D + HALF + c[None, :], mask=cm, other=0.0)
        s_lo = tl.load(sin_ptr + r[:, None] * D + c[None, :], mask=cm, other=0.0)
        s_hi = tl.load(sin_ptr + r[:, None] * D + HALF + c[None, :], mask=cm, other=0.0)
        o_lo = y_lo * c_lo + (-y_hi) * s_lo
        o_hi = y_hi * c_hi + y_lo * s_hi
    else:
        o_lo = y_lo
        o_hi = y_hi
    dst = out_ptr + layer * s_l + h * s_h + (tok + j)[:, None] * s_t
    ty = out_ptr.dtype.element_ty
    tl.store(dst + c[None, :], o_lo.to(ty), mask=jm[:, None] & lo_m[None, :])
    tl.store(dst + HALF + c[None, :], o_hi.to(ty), mask=jm[:, None] & hi_m[None, :])


def decode_rows(u, blobs, ch_off, ch_first, ch_mode, step, mean, lsc, cos, sin, basis_t, out) -> None:
    """``reference.decode_rows`` in one launch."""
    n = blobs.shape[0]
    if n == 0:
        return
    _, h, _, d = out.shape
    assert out.stride(3) == 1
    half = d // 2
    hp = max(16, triton.next_power_of_2(d - half))
    t_max = int(blobs[:, 2].max())
    if t_max == 0:
        return
    grid = (n * h, triton.cdiv(t_max, BT))
    _rows_kernel[grid](u, blobs, ch_off, ch_first, ch_mode, step, mean, lsc, cos, sin,
                       basis_t if basis_t is not None else step, out, out.stride(0), out.stride(1), out.stride(2),
                       h, d, half, HAS_BASIS=basis_t is not None, HP=hp, BT=BT)
