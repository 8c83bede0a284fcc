"""Plain-torch references of the KVCrush selection pieces. They define the semantics the
Triton kernels in ``triton.py`` must reproduce bit for bit (all outputs are integers or
copies, so there is no tolerance).

Bit vectors are packed 32 bits to an int32 word, bit i of the vector at bit (i % 32) of word
i // 32 (little-endian within the word); unused high bits are 0 in data and anchor alike,
so they never add to a distance.
"""

from __future__ import annotations

import torch
from torch import Tensor

WORD_BITS = 32


def binarize(scores: Tensor, thresholds: Tensor, out: Tensor | None = None) -> Tensor:
    """``[..., T]`` scores vs ``[...]`` per-row thresholds -> uint8 bits (1 = score > thr).

    Strictly greater, so a row of equal scores gives all zeros and NaN scores give 0.
    """
    bits = (scores.float() > thresholds.float().unsqueeze(-1)).to(torch.uint8)
    if out is None:
        return bits
    out.copy_(bits)
    return out


def pack_bits(bits: Tensor) -> Tensor:
    """``[..., n]`` 0/1 -> int32 ``[..., ceil(n/32)]`` (shared by both paths, not a kernel)."""
    n = bits.shape[-1]
    n_words = max(1, -(-n // WORD_BITS))
    words = torch.zeros(*bits.shape[:-1], n_words, dtype=torch.int64, device=bits.device)
    # one shift-or per bit: cheap for the 3..90-bit vectors KVCrush uses, no 32x padding
    for i in range(n):
        words[..., i // WORD_BITS] |= bits[..., i].to(torch.int64) << (i % WORD_BITS)
    # reinterpret as two's-complement int32: values >= 2**31 wrap to negatives
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def popcount32(x: Tensor) -> Tensor:
    """Set bits of each int32 word, as int32 (the high bit of a negative word counts too).

    A 256-entry table over the word's bytes: four lookups instead of 32 shift-and-adds."""
    table = torch.tensor([bin(i).count("1") for i in range(256)], dtype=torch.int32, device=x.device)
    as_bytes = x.to(torch.int32).contiguous().view(torch.uint8).long()
    return table[as_bytes].view(*x.shape, 4).sum(-1, dtype=torch.int32)


def hamming(words: Tensor, anchor: Tensor, out: Tensor | None = None) -> Tensor:
    """int32 ``[G, N, W]`` packed vectors, int32 ``[G, W]`` anchors -> int32 ``[G, N]``."""
    dist = popcount32(torch.bitwise_xor(words, anchor.unsqueeze(1))).sum(-1, dtype=torch.int32)
    if out is None:
        return dist
    out.copy_(dist)
    return out


def gather_kept(x: Tensor, idx: Tensor, out: Tensor | None = None) -> Tensor:
    """``[L, H, T, D]`` and int64 ``[L, H, k]`` -> ``[L, H, k, D]`` (rows idx along T)."""
    d = x.shape[-1]
    res = torch.gather(x, 2, idx.unsqueeze(-1).expand(*idx.shape, d))
    if out is None:
        return res
    out.copy_(res)
    return out
