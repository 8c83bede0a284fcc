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
COPIES = 4  # histograms per frame counted at once (see codes_blob_bytes)


@njit
def codes_blob_bytes(codes, bins, row_peak, own_widths=False):
    """``len`` of ``encode_codes(codes, "deflate", own_widths=own_widths)``'s blob, for integer
    ``codes [H, T, D]`` (float32, as the quantizer leaves them), their ``bins [H * D]``
    (``spread_bins``, flattened) and each row's largest ``|code|`` (:func:`spread_bins_exact`
    gives both); -1 where a code is beyond int16 (the encoder refuses it). The frames take the
    channels of one bin each, bins ascending, rows ``(head, channel)`` ascending, ``T`` codes per
    row; their bytes are counted, not stored.

    A frame of one block whose codes take whole bytes (not packed as digits) has a histogram
    that does not depend on the order of its codes: those frames are counted in one pass over
    ``codes`` as they lie. Frames of packed digits (a byte holds neighbouring codes of a row)
    and frames of several blocks (where a block ends depends on the order) read their rows in
    the frame's order."""
    h_n, t, d = codes.shape
    hd = h_n * d
    lim = 0
    for r in range(hd):
        if row_peak[r] > lim:
            lim = row_peak[r]
    if lim > 32767:
        return -1
    width = 1 if lim <= 127 else 2
    counts = np.zeros(256, np.int64)
    peaks = np.zeros(256, np.int64)
    for r in range(hd):
        counts[bins[r]] += 1
        if row_peak[r] > peaks[bins[r]]:
            peaks[bins[r]] = row_peak[r]
    # per bin: its frame's codes per byte, bytes per code, bytes, and where its histogram is
    # counted (-1: in the frame's order)
    per_of = np.zeros(256, np.int64)
    fw_of = np.zeros(256, np.int64)
    n_of = np.zeros(256, np.int64)
    slot_of = np.full(256, -1, np.int64)
    n_direct = 0
    total = 2
    for v in range(256):
        if counts[v] == 0:
            continue
        total += 6
        per = codes_per_byte(peaks[v])
        fw = 1 if own_widths and peaks[v] <= 127 else width  # (digits.frame_width)
        per_of[v], fw_of[v] = per, fw
        n_of[v] = (counts[v] * t + per - 1) // per if per > 1 else counts[v] * t * fw
        if per == 1 and n_of[v] < BLOCK_LITERALS:
            slot_of[v] = n_direct
            n_direct += 1
    work = new_work()
    hist = np.zeros(256, np.int64)
    if n_direct:
        # COPIES histograms per frame, a channel adding to copy c % COPIES: the codes of a frame
        # are mostly a few values, and one counter incremented back to back waits on its last store
        hists = np.zeros((n_direct * COPIES, 256), np.int32)
        slot = np.empty(hd, np.int64)
        wide = np.empty(hd, np.bool_)
        for r in range(hd):
            k = slot_of[bins[r]]
            slot[r] = -1 if k < 0 else k * COPIES + r % COPIES
            wide[r] = fw_of[bins[r]] == 2
        for h in range(h_n):
            for j in range(t):
                for c in range(d):
                    r = h * d + c
                    k = slot[r]
                    if k >= 0:
                        q = np.int32(codes[h, j, c])
                        hists[k, q & 0xFF] += 1
                        if wide[r]:
                            hists[k, (q >> 8) & 0xFF] += 1
        for v in range(256):
            k = slot_of[v]
            if k >= 0:
                for b in range(256):
                    acc = 0
                    for e in range(COPIES):
                        acc += hists[k * COPIES + e, b]
                    hist[b] = acc
                total += close_stream(hist, n_of[v], 0, work)
    members = np.empty(hd, np.int64)
    buf = np.empty(hd * t, np.int32)
    for v in range(256):
        if counts[v] == 0 or slot_of[v] >= 0 or per_of[v] == 0:
            continue
        m = 0
        for r in range(hd):
            if bins[r] == v:
                members[m] = r
                m += 1
        if n_of[v] < BLOCK_LITERALS:  # one block: no block check per byte
            _frame_hist(codes, members, m, t, per_of[v], peaks[v], hist, buf)
            total += close_stream(hist, n_of[v], 0, work)
        else:
            total += _frame_blocks(codes, members, m, t, per_of[v], peaks[v], fw_of[v], hist, work)
    return total


@njit
def _frame_hist(codes, members, m, t, per, peak, hist, buf):
    """The byte histogram of one frame of packed digits: base-radix digits, least significant
    first, ``per`` to a byte (the last byte's missing digits 0), rows in the frame's order.
    The rows are first gathered into ``buf`` (each a strided read), then each byte is a sum of
    ``per`` digits times fixed powers: no multiply waits on the one before."""
    d = codes.shape[2]
    n = m * t
    for i in range(m):
        h, c = members[i] // d, members[i] % d
        for j in range(t):
            buf[i * t + j] = np.int32(codes[h, j, c]) + peak
    radix = 2 * peak + 1
    pw = np.ones(per, np.int32)
    for k in range(1, per):
        pw[k] = pw[k - 1] * radix
    whole = n // per
    h4 = np.zeros((COPIES, 256), np.int32)
    for b in range(whole):
        acc = 0
        for k in range(per):
            acc += buf[b * per + k] * pw[k]
        h4[b % COPIES, acc] += 1
    if n > whole * per:
        acc = 0
        for k in range(n - whole * per):
            acc += buf[whole * per + k] * pw[k]
        h4[0, acc] += 1
    for e in range(COPIES):
        for v in range(256):
            hist[v] += h4[e, v]


@njit
def _frame_blocks(codes, members, m, t, per, peak, width, hist, work):
    """One frame of more than one block: its bytes, block by block."""
    if per == 1:
        return _byte_rows_blocks(codes, members, m, t, width, hist, work)
    d = codes.shape[2]
    n = bitpos = 0
    radix = 2 * peak + 1
    acc, k, mul = 0, 0, 1
    for i in range(m):
        h, c = members[i] // d, members[i] % d
        for j in range(t):
            q = np.int64(codes[h, j, c])
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


@njit
def _byte_rows_blocks(codes, members, m, t, width, hist, work):
    """:func:`_frame_blocks` of a frame of whole-byte codes (one code per ``width`` bytes): a
    row that ends inside the open block is counted without a check per byte, into ``COPIES``
    histograms (a block's histogram does not depend on the order of its bytes); a row that
    reaches the block's end goes byte by byte."""
    d = codes.shape[2]
    h4 = np.zeros((COPIES, 256), np.int64)
    n = bitpos = 0
    for i in range(m):
        h, c = members[i] // d, members[i] % d
        if width == 1 and n + t < BLOCK_LITERALS:
            for j in range(t):
                h4[j % COPIES, np.int64(codes[h, j, c]) & 0xFF] += 1
            n += t
            continue
        for j in range(t):
            q = np.int64(codes[h, j, c])
            for _ in range(width):
                h4[0, q & 0xFF] += 1
                q >>= 8
                n += 1
                if n == BLOCK_LITERALS:
                    for e in range(COPIES):
                        for v in range(256):
                            hist[v] += h4[e, v]
                    h4[:] = 0
                    bitpos = close_block(hist, n, work, bitpos)
                    n = 0
    for e in range(COPIES):
        for v in range(256):
            hist[v] += h4[e, v]
    return close_stream(hist, n, bitpos, work)


BIN_MARGIN = 1e-4  # (bins of a log2) float32 arithmetic lands within ~5e-6 of the float64 value: 20x that


@njit
def spread_bins_exact(codes, bins, row_peak, per_octave):
    """``spread_bins(codes, per_octave=per_octave)`` (flattened to ``bins [H * D]``) for integer ``codes [H, T, D]``
    (float32), and each row's largest ``|code|`` in ``row_peak [H * D]``: each channel's spread
    from exact integer sums, its bin in float64. False where a
    channel lies within ``BIN_MARGIN`` of a bin's edge, where float32 arithmetic could round it
    the other way: the caller takes torch's ``spread_bins`` for that chunk."""
    h_n, t, d = codes.shape
    # integer sums held in float64, exact while below 2**53 (|code| <= 32767, so for T < 2**22
    # tokens): the loop over channels runs in vector registers, where int64 multiplies do not
    s1 = np.zeros(d, np.float64)
    s2 = np.zeros(d, np.float64)
    mx = np.zeros(d, np.float64)
    ok = True
    for h in range(h_n):
        s1[:] = 0
        s2[:] = 0
        mx[:] = 0
        for j in range(t):
            for c in range(d):
                q = np.float64(codes[h, j, c])
                s1[c] += q
                s2[c] += q * q
                mx[c] = max(mx[c], abs(q))
        for c in range(d):
            row_peak[h * d + c] = np.int64(mx[c])
            if t == 0:
                bins[h * d + c] = 4
                continue
            if t > 1:
                # exact integers (t * s2 and s1 * s1 below 2**53 too), one rounding
                var = (np.int64(t) * np.int64(s2[c]) - np.int64(s1[c]) * np.int64(s1[c])) / (float(t) * float(t))
                spread = np.sqrt(max(var, 0.0))
            else:
                spread = float(mx[c])
            v = np.log2(spread + 0.25) * per_octave
            f = v - np.floor(v)
            if abs(f - 0.5) < BIN_MARGIN:
                ok = False
            b = np.floor(v + 0.5)
            bins[h * d + c] = int(min(max(b, -4.0), 40.0)) + 4
    return ok


@njit
def group_blob_bytes(codes, bins, row_peak, exact, per_octave, count=True):
    """Chunks of one length together: for each ``codes[g] [H, T, D]`` (float32 integers),
    :func:`spread_bins_exact` into ``bins[g]``, ``row_peak[g]`` and ``exact[g]``, then, where exact
    and ``count``, :func:`codes_blob_bytes` (``own_widths`` False). Returns each chunk's bytes (-1:
    a code beyond int16; 0 where not exact or not counted: the caller bins an inexact chunk with
    torch's ``spread_bins``). One call per group instead of two per chunk: no Python between the
    chunks."""
    sizes = np.zeros(codes.shape[0], np.int64)
    for g in range(codes.shape[0]):
        exact[g] = spread_bins_exact(codes[g], bins[g], row_peak[g], per_octave)
        if exact[g] and count:
            sizes[g] = codes_blob_bytes(codes[g], bins[g], row_peak[g], False)
    return sizes


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


def writes_zlib_bytes() -> bool:
    """The compiled writer (``huffman_only``) writes this process's zlib's bytes (one stream of
    each kind of block)."""
    from kdnctl.quant.coders.deflate import deflate_compress

    from .huffman_only import deflate

    g = np.random.default_rng(3)
    streams = [np.zeros(1, np.uint8), g.integers(0, 256, 300).astype(np.uint8),
               np.minimum(g.geometric(0.2, BLOCK_LITERALS + 9), 255).astype(np.uint8)]
    return all(deflate(s.tobytes()) == deflate_compress(s.tobytes()) for s in streams)


def warm() -> bool:
    """Compile the counting kernels and the encoder's (the frame cutter, the Huffman-only writer,
    the channel variances, the rounding with feedback) now (numba keeps them on disk;
    ``scripts/install.sh`` and a compress loading its model call this) and check them: True when
    this zlib is the one counted, the writer writes its bytes, and a made-up blob counts to the
    encoder's bytes at either width."""
    import torch

    from kdnctl.kernels.channel_stats import cpu as channel_stats_cpu
    from kdnctl.kernels.feedback import cpu as feedback_cpu
    from kdnctl.quant.entropy import SPREAD_BINS_PER_OCTAVE, encode_codes, spread_bins

    w = np.ones((2, 2))
    feedback_cpu.round_tokens(w, np.eye(2), np.zeros(2), np.ones((2, 2)), np.empty((2, 2)))
    channel_stats_cpu.channel_var(np.ones((1, 2, 2), np.float32))  # (the frame cutter compiles in encode_codes below)
    codes = torch.round(torch.randn(2, 9, 4, generator=torch.Generator().manual_seed(0)) * 3)
    codes[0, 0, 0] = 300.0  # two-byte codes: the frames' widths differ between the two blobs
    bins, peaks = spread_bins(codes).flatten().numpy(), np.empty(8, np.int64)
    spread_bins_exact(codes.numpy(), np.empty(8, np.uint8), peaks, SPREAD_BINS_PER_OCTAVE)
    exact = np.empty(1, np.bool_)
    group = (np.empty((1, 8), np.uint8), np.empty((1, 8), np.int64), exact)
    group_blob_bytes(codes.numpy()[None], *group, SPREAD_BINS_PER_OCTAVE, False)  # (the final encode's signature)
    counted = int(group_blob_bytes(codes.numpy()[None], *group, SPREAD_BINS_PER_OCTAVE)[0])
    encoded = {own: len(encode_codes(codes, "deflate", own_widths=own)[0]) for own in (False, True)}
    return matches_zlib() and writes_zlib_bytes() and all(codes_blob_bytes(codes.numpy(), bins, peaks, own) == encoded[own] for own in encoded) \
        and (not exact[0] or counted == encoded[False])
