"""The size of an ``ec`` codes blob without deflating it: zlib's Huffman-only deflate, counted.

A deflated frame's bytes are a function of its byte histograms, block by block
(``zlib_blocks``, exact for zlib's Huffman-only blocks). :func:`codes_blob_bytes` counts every
frame of a role's codes as
``kdnctl.quant.entropy.encode_codes`` would cut them (``own_widths`` False: what the scale
fit measures; True: what a version stores), generating each frame's bytes on the fly.

The reference is zlib itself: ``tests/test_deflate_size.py`` checks the counts against real
deflates, and :func:`matches_zlib` checks this process's zlib once before the encoder relies on
the counts (another deflate implementation, e.g. zlib-ng, blocks differently: the encoder then
deflates every probe as before).
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from . import digits
from .zlib_blocks import BLOCK_LITERALS, block_bits, close_block, close_stream, new_work, stream_bytes  # noqa: F401

njit = functools.partial(numba.njit, nogil=True, cache=True)

codes_per_byte = njit(digits.codes_per_byte)


@njit
def codes_blob_bytes(codes, bins, row_peak, own_widths=False):
    """``len`` of ``encode_codes(codes, "deflate", own_widths=own_widths)``'s blob, for integer
    ``codes [H, T, D]`` (float32, as the quantizer leaves them), their ``bins [H * D]``
    (``spread_bins``, flattened) and each row's largest ``|code|`` (:func:`spread_bins_exact`
    gives both); -1 where a code is beyond int16 (the encoder refuses it). The frames take the
    channels of one bin each, bins ascending, rows ``(head, channel)`` ascending, ``T`` codes per
    row; their bytes are counted, not stored."""
    h_n, t, d = codes.shape
    hd = h_n * d
    lim = 0
    for r in range(hd):
        if row_peak[r] > lim:
            lim = row_peak[r]
    if lim > 32767:
        return -1
    width = 1 if lim <= 127 else 2
    rows = np.empty((hd, t), np.int32)  # channel-major, as the frames take them; copied in tiles of tokens
    for h in range(h_n):
        for j0 in range(0, t, 32):
            j1 = min(t, j0 + 32)
            for c in range(d):
                for j in range(j0, j1):
                    rows[h * d + c, j] = np.int32(codes[h, j, c])
    counts = np.zeros(256, np.int64)
    for r in range(hd):
        counts[bins[r]] += 1
    work = new_work()
    hist = np.zeros(256, np.int64)
    members = np.empty(hd, np.int64)
    total = 2
    for v in range(256):
        if counts[v] == 0:
            continue
        total += 6
        m, peak = 0, 0
        for r in range(hd):
            if bins[r] == v:
                members[m] = r
                m += 1
                if row_peak[r] > peak:
                    peak = row_peak[r]
        per = codes_per_byte(peak)
        if per == 0:
            continue
        fw = 1 if own_widths and peak <= 127 else width  # (digits.frame_width)
        n_bytes = (m * t + per - 1) // per if per > 1 else m * t * fw
        if n_bytes < BLOCK_LITERALS:  # one block (most frames): no block check per byte
            _frame_hist(rows, members, m, t, per, peak, fw, hist)
            total += close_stream(hist, n_bytes, 0, work)
        else:
            total += _frame_blocks(rows, members, m, t, per, peak, fw, hist, work)
    return total


@njit
def _frame_hist(rows, members, m, t, per, peak, width, hist):
    """The byte histogram of one frame's rows."""
    if per > 1:  # base-radix digits, least significant first, per to a byte (the last byte's missing digits 0)
        radix = 2 * peak + 1
        acc, k, mul = 0, 0, 1
        for i in range(m):
            row = rows[members[i]]
            for j in range(t):
                acc += (row[j] + peak) * mul
                mul *= radix
                k += 1
                if k == per:
                    hist[acc] += 1
                    acc, k, mul = 0, 0, 1
        if k > 0:
            hist[acc] += 1
    elif width == 1:
        for i in range(m):
            row = rows[members[i]]
            for j in range(t):
                hist[row[j] & 0xFF] += 1
    else:  # little-endian int16
        for i in range(m):
            row = rows[members[i]]
            for j in range(t):
                hist[row[j] & 0xFF] += 1
                hist[(row[j] >> 8) & 0xFF] += 1


@njit
def _frame_blocks(rows, members, m, t, per, peak, width, hist, work):
    """One frame of more than one block: its bytes, block by block."""
    n = bitpos = 0
    radix = 2 * peak + 1
    acc, k, mul = 0, 0, 1
    for i in range(m):
        row = rows[members[i]]
        for j in range(t):
            q = np.int64(row[j])
            if per > 1:
                acc += (q + peak) * mul
                mul *= radix
                k += 1
                if k < per:
                    continue
                q, acc, k, mul = acc, 0, 0, 1
            for _ in range(width if per == 1 else 1):
                hist[q & 0xFF] += 1
                q >>= 8
                n += 1
                if n == BLOCK_LITERALS:
                    bitpos = close_block(hist, n, work, bitpos)
                    n = 0
    if k > 0:
        hist[acc] += 1
        n += 1
        if n == BLOCK_LITERALS:
            bitpos = close_block(hist, n, work, bitpos)
            n = 0
    return close_stream(hist, n, bitpos, work)


BIN_MARGIN = 1e-4  # (twice the log2) float32 arithmetic lands within ~5e-6 of the float64 value: 20x that


@njit
def spread_bins_exact(codes, bins, row_peak):
    """``spread_bins(codes)`` (flattened to ``bins [H * D]``) for integer ``codes [H, T, D]``
    (float32), and each row's largest ``|code|`` in ``row_peak [H * D]``: each channel's spread
    from exact integer sums, its bin in float64. False where a
    channel lies within ``BIN_MARGIN`` of a bin's edge, where float32 arithmetic could round it
    the other way: the caller takes torch's ``spread_bins`` for that chunk."""
    h_n, t, d = codes.shape
    s1 = np.zeros(d, np.int64)
    s2 = np.zeros(d, np.int64)
    mx = np.zeros(d, np.int64)
    ok = True
    for h in range(h_n):
        s1[:] = 0
        s2[:] = 0
        mx[:] = 0
        for j in range(t):
            for c in range(d):
                q = np.int64(codes[h, j, c])
                s1[c] += q
                s2[c] += q * q
                a = abs(q)
                if a > mx[c]:
                    mx[c] = a
        for c in range(d):
            row_peak[h * d + c] = mx[c]
            if t == 0:
                bins[h * d + c] = 4
                continue
            if t > 1:
                var = (t * s2[c] - s1[c] * s1[c]) / (float(t) * float(t))  # exact integers, one rounding
                spread = np.sqrt(max(var, 0.0))
            else:
                spread = float(mx[c])
            v = np.log2(spread + 0.25) * 2.0
            f = v - np.floor(v)
            if abs(f - 0.5) < BIN_MARGIN:
                ok = False
            b = np.floor(v + 0.5)
            bins[h * d + c] = int(min(max(b, -4.0), 40.0)) + 4
    return ok


@functools.lru_cache(maxsize=1)
def matches_zlib() -> bool:
    """This process's zlib writes the bytes these counts describe (checked on streams that take
    every kind of block: one symbol, skewed, uniform bytes that stay stored, several blocks)."""
    from kdnctl.quant.coders.deflate import deflate_compress

    g = np.random.default_rng(7)
    streams = [np.zeros(1, np.uint8), np.full(5000, 3, np.uint8), g.integers(0, 256, 3000).astype(np.uint8),
               np.minimum(g.geometric(0.3, 70001), 255).astype(np.uint8),
               np.minimum(g.geometric(0.05, 2 * BLOCK_LITERALS), 255).astype(np.uint8)]
    return all(stream_bytes(s) == len(deflate_compress(s.tobytes())) for s in streams)


def warm() -> bool:
    """Compile the counting kernels now (numba keeps them on disk; ``scripts/install.sh`` and a
    compress loading its model call this) and check them: True when this zlib is the one counted
    and a made-up blob counts to the encoder's bytes at either width."""
    import torch

    from kdnctl.kernels.feedback import cpu as feedback_cpu
    from kdnctl.quant.entropy import encode_codes, spread_bins

    w = np.ones((2, 2))
    feedback_cpu.round_tokens(w, np.eye(2), np.zeros(2), np.ones((2, 2)), np.empty((2, 2)))
    codes = torch.round(torch.randn(2, 9, 4, generator=torch.Generator().manual_seed(0)) * 3)
    codes[0, 0, 0] = 300.0  # two-byte codes: the frames' widths differ between the two blobs
    bins, peaks = spread_bins(codes).flatten().numpy(), np.empty(8, np.int64)
    spread_bins_exact(codes.numpy(), np.empty(8, np.uint8), peaks)
    return matches_zlib() and all(
        codes_blob_bytes(codes.numpy(), bins, peaks, own) == len(encode_codes(codes, "deflate", own_widths=own)[0])
        for own in (False, True))
