"""The device half of an ec decode in plain torch: the spec the Triton kernel is tested against.

Inputs (one role of many blobs; a blob is one layer of one role of one chunk):

- ``u`` uint8 ``[N]``: every code frame inflated, as stored: one code per byte (int8), two
  (int16, little-endian), or base-``2 peak + 1`` digits, ``per`` to a byte, least significant first.
- ``blobs`` int64 ``[n, 6]``, ``BLOB_FIELDS``: the cache layer, the first token's row in the
  cache, the chunk's tokens ``t``, the offset of its level scales in ``lsc``, its first row in
  ``cos``/``sin`` (-1: no RoPE), and the rows between heads there (0: every head shares them).
- ``ch_off``/``ch_first`` int64, ``ch_mode`` int32, ``[n, H*D]``: per channel its frame's
  offset in ``u``, its first code's index in the frame, and codes per byte | bytes per code << 4
  | peak << 8 (codes per byte 0: every code is 0).
- ``step``/``mean`` float32 ``[n, H*D]``; ``lsc`` float32: each token's ``2**-level``.
- ``cos``/``sin`` float32 ``[R, D]``; ``basis_t`` float32 ``[L, H, D, D]`` (the transposed key
  basis: ``x = (z @ B^T) * step + mean``) or None.

``out [L, H, T, D]`` (any float dtype) gets ``out[layer, h, tok + j] = rope(y)``, where
``y = code * lsc[j] * step + mean`` (no basis; each product rounded, as the CPU decoder
computes), or ``y = (code * lsc[j]) @ (B^T * step) + mean``.
"""

from __future__ import annotations

import torch

BLOB_FIELDS = ("layer", "tok", "t", "lsc_off", "cs_row", "cs_head_rows")


def codes_of(u: torch.Tensor, off: torch.Tensor, first: torch.Tensor, mode: torch.Tensor, t: int) -> torch.Tensor:
    """int32 ``[C, t]``: each channel's ``t`` codes (``off``/``first``/``mode`` ``[C]``)."""
    per, fw, peak = mode & 15, (mode >> 4) & 15, mode >> 8
    i = first.unsqueeze(1) + torch.arange(t, dtype=torch.int64, device=u.device)  # [C, t]: index in the frame
    codes = torch.zeros(i.shape, dtype=torch.int32, device=u.device)
    u32 = u.to(torch.int32)
    one = (per == 1) & (fw == 1)
    if one.any():
        v = u32[off[one].unsqueeze(1) + i[one]]
        codes[one] = torch.where(v >= 128, v - 256, v)
    two = (per == 1) & (fw == 2)
    if two.any():
        a = off[two].unsqueeze(1) + 2 * i[two]
        v = u32[a] | (u32[a + 1] << 8)
        codes[two] = torch.where(v >= 32768, v - 65536, v)
    packed = per > 1
    if packed.any():
        p, k = per[packed].unsqueeze(1).long(), i[packed]
        radix = (2 * peak[packed] + 1).unsqueeze(1)
        byte = u32[off[packed].unsqueeze(1) + k // p]
        codes[packed] = (byte // radix ** (k % p).to(torch.int32)) % radix - peak[packed].unsqueeze(1)
    return codes


def rope(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``y * cos + rotate_half(y) * sin`` (``y [..., D]``), each product rounded, then the sum."""
    half = y.shape[-1] // 2
    rot = torch.cat([-y[..., half:], y[..., :half]], -1)
    return y * cos + rot * sin


def decode_rows(u, blobs, ch_off, ch_first, ch_mode, step, mean, lsc, cos, sin, basis_t, out) -> None:
    """Every blob's rows into ``out`` (the module's docstring has the layouts)."""
    n_heads, d = out.shape[1], out.shape[3]
    for b, (layer, tok, t, lo, cs_row, cs_heads) in enumerate(blobs.tolist()):
        if t == 0:
            continue
        codes = codes_of(u, ch_off[b], ch_first[b], ch_mode[b], t)
        z = codes.to(torch.float32).view(n_heads, d, t) * lsc[lo:lo + t]  # [H, D, t]
        st, mu = step[b].view(n_heads, 1, d), mean[b].view(n_heads, 1, d)
        if basis_t is not None:
            y = torch.baddbmm(mu, z.transpose(1, 2), basis_t[layer] * st)
        else:
            y = z.transpose(1, 2) * st + mu
        if cs_row >= 0:
            rows = cs_row + torch.arange(n_heads if cs_heads else 1, device=u.device).unsqueeze(1) * cs_heads + \
                torch.arange(t, device=u.device)
            y = rope(y, cos[rows], sin[rows])
        out[layer, :, tok:tok + t] = y.to(out.dtype)
