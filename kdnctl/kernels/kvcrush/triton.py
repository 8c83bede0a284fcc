"""Triton kernels of the KVCrush selection pieces; ``reference.py`` defines the semantics.

Imported lazily by the dispatcher (``__init__.py``) only when a call runs on Triton, so
importing kdnctl never needs triton or a GPU. With ``TRITON_INTERPRET=1`` (set before this
module is imported) the same kernels run on CPU tensors, which is how the tests check them.
Callers pass already-validated contiguous tensors (the dispatcher does that).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

BLOCK_T = 128  # tokens per program: a power of two, small enough for the interpreter


@triton.jit
def _binarize_kernel(s_ptr, thr_ptr, out_ptr, T, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: rows * T can pass 2**31 on long documents
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < T
    s = tl.load(s_ptr + row * T + offs, mask=m, other=0.0)
    thr = tl.load(thr_ptr + row)
    tl.store(out_ptr + row * T + offs, (s > thr).to(tl.uint8), mask=m)


@triton.jit
def _popcount32(x):
    # SWAR popcount on uint32 without a multiply (the multiply variant overflows on purpose,
    # which the numpy-backed interpreter warns about).
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    x = x + (x >> 8)
    x = x + (x >> 16)
    return x & 0x3F


@triton.jit
def _hamming_kernel(w_ptr, a_ptr, out_ptr, N, W, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for j in range(W):
        w = tl.load(w_ptr + (g * N + offs) * W + j, mask=m, other=0)
        a = tl.load(a_ptr + g * W + j)
        # bitcast to unsigned so the shifts in the popcount are logical, not arithmetic
        x = (w ^ a).to(tl.uint32, bitcast=True)
        acc += _popcount32(x).to(tl.int32)
    tl.store(out_ptr + g * N + offs, acc, mask=m)


@triton.jit
def _gather_kernel(x_ptr, idx_ptr, out_ptr, T, K, D, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr):
    # one program per (layer*head, block of kept rows): all layers in one launch
    lh = tl.program_id(0).to(tl.int64)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mk = offs_k < K
    tok = tl.load(idx_ptr + lh * K + offs_k, mask=mk, other=0)
    offs_d = tl.arange(0, BLOCK_D)
    md = offs_d < D
    m = mk[:, None] & md[None, :]
    v = tl.load(x_ptr + lh * T * D + tok[:, None] * D + offs_d[None, :], mask=m)
    tl.store(out_ptr + lh * K * D + offs_k[:, None] * D + offs_d[None, :], v, mask=m)


def binarize(scores: Tensor, thresholds: Tensor, out: Tensor) -> Tensor:
    t = scores.shape[-1]
    rows = thresholds.numel()
    if rows and t:
        _binarize_kernel[(rows, triton.cdiv(t, BLOCK_T))](scores, thresholds, out, t, BLOCK=BLOCK_T)
    return out


def hamming(words: Tensor, anchor: Tensor, out: Tensor) -> Tensor:
    g, n, w = words.shape
    if g and n:
        _hamming_kernel[(g, triton.cdiv(n, BLOCK_T))](words, anchor, out, n, w, BLOCK=BLOCK_T)
    return out


def gather_kept(x: Tensor, idx: Tensor, out: Tensor) -> Tensor:
    l, h, t, d = x.shape
    k = idx.shape[-1]
    if l * h and k and d:
        block_k = 32
        block_d = triton.next_power_of_2(d)
        grid = (l * h, triton.cdiv(k, block_k))
        _gather_kernel[grid](x, idx, out, t, k, d, BLOCK_K=block_k, BLOCK_D=block_d)
    return out


__all__ = ["binarize", "hamming", "gather_kept"]
