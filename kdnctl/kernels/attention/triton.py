"""Triton decode attention over a dense or quantized KV cache; ``reference.py`` defines the
semantics (GQA, additive bias, float32 output) and validates the arguments for both backends.

Design (flash-decoding):

- Stage 1, grid ``(Hkv, splits)``: a program owns one KV head and one chunk of T. All query
  rows that read this KV head (``REP = Hq // Hkv`` heads x ``Q`` queries) are packed into one
  ``[BLOCK_H, D]`` tile, so each K/V element is read from memory once, not once per query head.
  The chunk is walked in ``BLOCK_T`` tokens with an online softmax (running max ``m``, sum
  ``l``, unnormalised accumulator); the program writes its partial ``(m, l, acc)``.
- Stage 2, grid ``(Hkv,)``: rescales the partials to a common max and normalises.

Splitting T is what keeps a GPU busy: a decode step has only ``Hkv`` (8 for a 7-8B model) head
programs, far fewer than the SMs, so T is cut into enough chunks for ~2 programs per SM.

Quantized K/V are dequantized tile by tile in registers (``_tile``): codes, scale and zero are
gathered per element with the layout's index arithmetic, so the dense cache never exists in
memory. Element values equal ``kdnctl.kernels.quant.reference.dequantize`` bit for bit (same
float32 ``code * scale + zero``). Softmax runs in base 2 (``exp2`` with log2(e) folded into the
scale and bias), the usual flash-attention trick; the difference is a rounding effect.

Dots use ``input_precision="ieee"`` (true float32): TF32 would be faster on tensor cores but adds
~1e-3 relative error that the test tolerances do not allow; decode is memory-bound anyway.

Shape limits (checked in ``decode_attention``): ``REP * Q <= 128`` query rows per KV head and
``D <= 256``. Any D works (40, 80, 96...): the D axis is padded to a power of two and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import reference as ref

BLOCK_T = 64  # tokens per inner step: two [64, D<=128] float32 tiles fit in registers (untuned)
MAX_ROWS = 128  # query rows per KV head held in one tile
_KIND = {"dense": 0, "int8": 1, "int4": 2, "fp8": 3}
_LAYOUT = {"channel": 0, "token": 1}
_LOG2E = 1.4426950408889634


@triton.jit
def _tile(x_ptr, s_ptr, z_ptr, t, d, mask, sxt, sxd, sst, ssd, G,
          KIND: tl.constexpr, LAYOUT: tl.constexpr):
    """``[BLOCK_T, BLOCK_D]`` float32 tile of one head's K or V (pointers already at the head).

    KIND 0 = dense (s_ptr/z_ptr unused); 1 int8, 2 int4, 3 fp8 codes. LAYOUT 0 = "channel"
    (groups and int4 pairs run along T), 1 = "token" (along D). Masked elements come out 0.
    """
    tt = t[:, None]
    dd = d[None, :]
    if KIND == 0:
        x = tl.load(x_ptr + tt * sxt + dd * sxd, mask=mask, other=0.0).to(tl.float32)
    else:
        if LAYOUT == 0:
            n = tt  # index along the grouped axis
            s_off = (tt // G) * sst + dd * ssd
            if KIND == 2:
                q_off = (tt // 2) * sxt + dd * sxd
            else:
                q_off = tt * sxt + dd * sxd
        else:
            n = dd
            s_off = tt * sst + (dd // G) * ssd
            if KIND == 2:
                q_off = tt * sxt + (dd // 2) * sxd
            else:
                q_off = tt * sxt + dd * sxd
        c = tl.load(x_ptr + q_off, mask=mask, other=0)
        if KIND == 2:
            c = tl.where((n % 2) == 1, c >> 4, c & 0x0F)  # low nibble = even index
        if KIND == 3:
            f = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            f = c.to(tl.float32)
        # Scale/zero are gathered per element: neighbouring elements of a group hit the same
        # cache line, so DRAM traffic stays one read per group.
        sc = tl.load(s_ptr + s_off, mask=mask, other=1.0).to(tl.float32)
        zr = tl.load(z_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
        x = f * sc + zr
    return x


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, ks_ptr, kz_ptr, v_ptr, vs_ptr, vz_ptr, b_ptr, m_ptr, l_ptr, a_ptr,
    T, D, Q, REP, CHUNK, qk_scale,
    sqh, sqq, sqd,
    skh, skt, skd, sksh, skst, sksd, GK,
    svh, svt, svd, svsh, svst, svsd, GV,
    sbh, sbq, sbt,
    K_KIND: tl.constexpr, K_LAYOUT: tl.constexpr, V_KIND: tl.constexpr, V_LAYOUT: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    kvh = tl.program_id(0).to(tl.int64)  # int64: head offsets of long caches pass 2**31 bytes
    split = tl.program_id(1)
    n_split = tl.num_programs(1)
    r = tl.arange(0, BLOCK_H)
    r_ok = r < REP * Q
    qh = kvh * REP + r // Q  # GQA: query head qh reads KV head qh // REP == kvh
    qi = r % Q
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    qv = tl.load(q_ptr + qh[:, None] * sqh + qi[:, None] * sqq + d[None, :] * sqd,
                 mask=r_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    k_base, ks_base, kz_base = k_ptr + kvh * skh, ks_ptr + kvh * sksh, kz_ptr + kvh * sksh
    v_base, vs_base, vz_base = v_ptr + kvh * svh, vs_ptr + kvh * svsh, vz_ptr + kvh * svsh

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    t_lo = split * CHUNK
    t_hi = tl.minimum(t_lo + CHUNK, T)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        t_ok = t < t_hi
        mask = t_ok[:, None] & d_ok[None, :]
        k = _tile(k_base, ks_base, kz_base, t, d, mask, skt, skd, skst, sksd, GK, K_KIND, K_LAYOUT)
        s = tl.dot(qv, tl.trans(k), input_precision="ieee") * qk_scale  # base-2 logits
        if HAS_BIAS:
            b = tl.load(b_ptr + qh[:, None] * sbh + qi[:, None] * sbq + t[None, :] * sbt,
                        mask=r_ok[:, None] & t_ok[None, :], other=0.0).to(tl.float32)
            s += b * 1.4426950408889634
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen only -inf so far (masked tokens) keeps m = -inf; subtracting a
        # finite stand-in avoids (-inf) - (-inf) = NaN and leaves p = alpha = 0.
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile(v_base, vs_base, vz_base, t, d, mask, svt, svd, svst, svsd, GV, V_KIND, V_LAYOUT)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    # Every row and column of the partial is written (padding rows too), so the combine stage
    # never reads uninitialised memory.
    o = (kvh * n_split + split) * BLOCK_H + r
    tl.store(m_ptr + o, m_i)
    tl.store(l_ptr + o, l_i)
    tl.store(a_ptr + o[:, None] * BLOCK_D + d[None, :], acc)


@triton.jit
def _combine_kernel(m_ptr, l_ptr, a_ptr, o_ptr, S, D, Q, REP, soh, soq, sod,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    kvh = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, BLOCK_H)
    r_ok = r < REP * Q
    qh = kvh * REP + r // Q
    qi = r % Q
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    base = kvh * S * BLOCK_H
    m_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(S):
        m_max = tl.maximum(m_max, tl.load(m_ptr + base + s * BLOCK_H + r))
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    l_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for s in range(S):
        o = base + s * BLOCK_H + r
        w = tl.exp2(tl.load(m_ptr + o) - m_use)  # 0 for a chunk that saw only masked tokens
        l_sum += w * tl.load(l_ptr + o)
        acc += w[:, None] * tl.load(a_ptr + o[:, None] * BLOCK_D + d[None, :])
    # l_sum == 0 only when every token of the row is -inf: output 0 (as sdpa), not 0/0.
    out = tl.where(l_sum[:, None] > 0, acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None], 0.0)
    tl.store(o_ptr + qh[:, None] * soh + qi[:, None] * soq + d[None, :] * sod, out,
             mask=r_ok[:, None] & d_ok[None, :])


def _operand(x):
    """Kernel arguments for one K/V operand: pointers, strides, group size, kind, layout."""
    if isinstance(x, ref.QuantizedKV):
        s, z = x.scale, x.zero
        if s.stride() != z.stride():  # the kernel indexes both with one set of strides
            s, z = s.contiguous(), z.contiguous()
        return (x.q, s, z), (*x.q.stride(), *s.stride(), x.group_size), _KIND[x.fmt], _LAYOUT[x.layout]
    # Dense: scale/zero pointers are never dereferenced (KIND 0); pass the tensor itself.
    return (x, x, x), (*x.stride(), 0, 0, 0, 1), _KIND["dense"], 0


def _default_splits(n_kv_heads: int, n_blocks: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, triton.cdiv(2 * sms, n_kv_heads))
    return 2  # interpreter: enough to exercise the combine stage without slowing tests


def decode_attention(
    query: torch.Tensor,
    k,
    v,
    bias: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    block_t: int = BLOCK_T,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton twin of :func:`reference.decode_attention`. ``out`` = preallocated float32 result;
    ``block_t`` (a power of two >= 16) and ``num_splits`` are tuning knobs (tests vary them)."""
    q3, b3, squeeze = ref.check_args(query, k, v, bias)
    hq, nq, d = q3.shape
    hkv, t, _ = ref.kv_shape(k)
    rep = hq // hkv
    rows = rep * nq
    if rows > MAX_ROWS:
        raise ValueError(f"{rows} query rows per KV head (Hq/Hkv * Q) > {MAX_ROWS}: too many for decode")
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= 16, got {block_t}")
    devices = {query.device, k.device, v.device} | ({bias.device} if bias is not None else set())
    if len(devices) != 1:
        raise ValueError(f"query, cache and bias must be on one device, got {devices}")
    scale = ref.default_scale(d) if scale is None else float(scale)
    out_shape = (hq, d) if squeeze else (hq, nq, d)
    if out is None:
        out = torch.empty(out_shape, dtype=torch.float32, device=query.device)
    elif tuple(out.shape) != out_shape or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 {out_shape}, got {out.dtype} {tuple(out.shape)}")
    if t == 0 or hq == 0 or d == 0:
        return out.zero_()  # no tokens: the (empty) weighted sum is 0, like the reference
    o3 = out[:, None, :] if squeeze else out

    # tl.dot needs every tile dimension >= 16 on GPUs; padding rows/columns are masked.
    block_h = max(16, triton.next_power_of_2(rows))
    block_d = max(16, triton.next_power_of_2(d))
    n_blocks = triton.cdiv(t, block_t)
    splits = num_splits if num_splits is not None else _default_splits(hkv, n_blocks, query.device)
    splits = max(1, min(int(splits), n_blocks))
    chunk = triton.cdiv(n_blocks, splits) * block_t  # whole blocks per chunk, so no empty chunk
    splits = triton.cdiv(t, chunk)
    dev = query.device
    m = torch.empty(hkv, splits, block_h, dtype=torch.float32, device=dev)
    lse = torch.empty_like(m)
    acc = torch.empty(hkv, splits, block_h, block_d, dtype=torch.float32, device=dev)

    (kx, ks, kz), kstr, k_kind, k_layout = _operand(k)
    (vx, vs, vz), vstr, v_kind, v_layout = _operand(v)
    if b3 is None:
        b_arg, bstr = m, (0, 0, 0)  # never read (HAS_BIAS=False)
    else:
        b_arg, bstr = b3, b3.stride()
    _split_kernel[(hkv, splits)](
        q3, kx, ks, kz, vx, vs, vz, b_arg, m, lse, acc,
        t, d, nq, rep, chunk, scale * _LOG2E,
        *q3.stride(), *kstr, *vstr, *bstr,
        K_KIND=k_kind, K_LAYOUT=k_layout, V_KIND=v_kind, V_LAYOUT=v_layout,
        HAS_BIAS=b3 is not None, BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_D=block_d,
    )
    _combine_kernel[(hkv,)](
        m, lse, acc, o3, splits, d, nq, rep, *o3.stride(), BLOCK_H=block_h, BLOCK_D=block_d,
    )
    return out


__all__ = ["BLOCK_T", "MAX_ROWS", "decode_attention"]
