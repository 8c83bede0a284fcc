"""The uncompressed frames of an ``ec`` codes blob, compiled: what ``kdnctl.quant.frames.frame_payloads``
(numpy, the reference) cuts, in one pass per blob into one buffer.

A version's encode cuts every (chunk, layer, role) blob into frames before deflating them; in
numpy that is a sort, a transposing gather, a cast and a copy per frame, ~0.5 ms of small array
work per blob. Here the rows are read in bin order straight from the quantizer's ``[H, T, D]``
codes (no gather into channel-major rows first) and written as the frame stores them: int8,
little-endian int16, or base-``2 peak + 1`` digits packed as ``kdnctl.kernels.ec.digits`` says.
``tests/test_frame_bytes.py`` holds it to the reference byte for byte.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from . import digits

njit = functools.partial(numba.njit, nogil=True, cache=True)

codes_per_byte = njit(digits.codes_per_byte)
frame_width = njit(digits.frame_width)


@njit
def frame_bytes(codes, bins, width):
    """``(buf, offsets, peaks)`` for integer ``codes [H, T, D]`` (float32, within int16), their
    spread ``bins [H * D]`` and the blob's ``width`` (1, 2 or ``OWN_WIDTHS``): frame ``f`` is
    ``buf[offsets[f]:offsets[f + 1]]`` (empty where every code is 0) and holds the channels of the
    ``f``-th bin that has any, rows ``(head, channel)`` ascending, ``T`` codes each; ``peaks[f]``
    its largest ``|code|``."""
    h_n, t, d = codes.shape
    hd = h_n * d
    counts = np.zeros(256, np.int64)
    for r in range(hd):
        counts[bins[r]] += 1
    n_frames = 0
    for v in range(256):
        if counts[v] > 0:
            n_frames += 1
    # each row's largest |code|, then each frame's
    row_peak = np.zeros(hd, np.int64)
    for h in range(h_n):
        for j in range(t):
            for c in range(d):
                q = abs(np.int64(codes[h, j, c]))
                if q > row_peak[h * d + c]:
                    row_peak[h * d + c] = q
    frame_of = np.full(256, -1, np.int64)
    peaks = np.zeros(n_frames, np.int64)
    f = 0
    for v in range(256):
        if counts[v] > 0:
            frame_of[v] = f
            f += 1
    for r in range(hd):
        k = frame_of[bins[r]]
        if row_peak[r] > peaks[k]:
            peaks[k] = row_peak[r]
    offsets = np.zeros(n_frames + 1, np.int64)
    f = 0
    for v in range(256):
        if counts[v] == 0:
            continue
        per = codes_per_byte(peaks[f])
        m = counts[v] * t
        n = 0 if per == 0 else m * frame_width(width, peaks[f]) if per == 1 else (m + per - 1) // per
        offsets[f + 1] = offsets[f] + n
        f += 1
    buf = np.zeros(offsets[n_frames], np.uint8)
    f = 0
    for v in range(256):
        if counts[v] == 0:
            continue
        peak = peaks[f]
        per = codes_per_byte(peak)
        o = offsets[f]
        f += 1
        if per == 0:
            continue
        fw = frame_width(width, peak)
        radix = 2 * peak + 1
        acc, k, mul = 0, 0, 1
        for r in range(hd):
            if bins[r] != v:
                continue
            h, c = r // d, r % d
            if per == 1:
                for j in range(t):
                    q = np.int64(codes[h, j, c]) & 0xFFFF
                    buf[o] = q & 0xFF
                    if fw == 2:
                        buf[o + 1] = q >> 8
                    o += fw
                continue
            for j in range(t):  # digits least significant first, ``per`` to a byte, across rows
                acc += (np.int64(codes[h, j, c]) + peak) * mul
                mul *= radix
                k += 1
                if k == per:
                    buf[o] = acc
                    o += 1
                    acc, k, mul = 0, 0, 1
        if k > 0:  # the last byte's missing digits are 0
            buf[o] = acc
    return buf, offsets, peaks
