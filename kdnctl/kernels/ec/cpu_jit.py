"""The compiled kernels of :mod:`kdnctl.kernels.ec.cpu`, at module level so that numba's disk
cache finds them again in the next process. (A closure's cells are part of numba's cache key,
and a cell holding a jitted function or an external symbol hashes differently in every process:
kernels built inside a function compiled again in every process, seconds before a first load.)

``init`` and ``stateless`` are ISA-L's functions, bound by name: import this module only after
``cpu._kernels`` has loaded the library into the process (``llvmlite.binding.load_library_permanently``).
"""

from __future__ import annotations

import functools

import numba
import numpy as np
from numba import types

from . import digits
from .errors import ERR_FRAMES, ERR_INFLATE, ERR_RANGE, ERR_SIZES, ERR_WIDTH, ERR_ZERO

njit = functools.partial(numba.njit, nogil=True, cache=True)
init = types.ExternalFunction("isal_inflate_init", types.void(types.voidptr))
stateless = types.ExternalFunction("isal_inflate_stateless", types.int32(types.voidptr))


@njit
def inflate_one(state, src_ptr, n_in, dst_ptr, n_out) -> bool:
    s64, s32 = state.view(np.uint64), state.view(np.uint32)
    s64[0] = dst_ptr
    s32[2] = n_out
    s64[2] = src_ptr
    s32[8] = n_in
    r = stateless(state.ctypes.data)
    return r == 0 and s32[2] == 0 and s32[8] == 0

@njit
def inflate_frames(src, s_off, s_len, dst, d_off, d_len, state, ok):
    """Frame f: ``src[s_off[f]:+s_len[f]]`` inflated to exactly ``d_len[f]`` bytes at ``d_off[f]``."""
    init(state.ctypes.data)
    sp, dp = src.ctypes.data, dst.ctypes.data
    for f in range(s_off.shape[0]):
        ok[f] = inflate_one(state, sp + s_off[f], s_len[f], dp + d_off[f], d_len[f])

codes_per_byte = njit(digits.codes_per_byte)
frame_width = njit(digits.frame_width)
OWN_WIDTHS = digits.OWN_WIDTHS

@njit
def digits_in_range(packed, per, peak) -> bool:
    """Every byte of ``packed`` holds ``per`` base-``2 peak + 1`` digits (is below ``radix**per``)."""
    radix, lim = 2 * peak + 1, 1
    for _ in range(per):
        lim *= radix
    top = 0
    for i in range(packed.shape[0]):
        if packed[i] > top:
            top = packed[i]
    return top < lim

@njit
def unpack_frame(scratch, n_bytes, width, per, peak, tables, zs, base, m) -> bool:
    """A frame's ``m`` codes (rows of ``t``, already inflated into ``scratch``; ``width``: the
    frame's bytes per code) at ``zs[base:base + m]``; packed digits may write up to ``per - 1`` codes past the end (the
    next frame overwrites them; ``zs`` has room). False: a byte holds digits out of range."""
    if per == 1 and width == 1:
        dst = zs[base:base + m]
        for i in range(m):
            v = np.int16(scratch[i])
            dst[i] = v - 256 if v >= 128 else v
    elif per == 1:
        dst = zs[base:base + m]
        for i in range(m):
            v = np.int32(scratch[2 * i]) | (np.int32(scratch[2 * i + 1]) << 8)
            dst[i] = v - 65536 if v >= 32768 else v
    else:
        if not digits_in_range(scratch[:n_bytes], per, peak):
            return False
        tab = tables[peak]
        dst = zs[base:base + n_bytes * per]
        for i in range(n_bytes):
            row = tab[scratch[i]]
            for e in range(per):
                dst[i * per + e] = row[e]
    return True

# byte masks of the 8x8 byte transpose in ``codes_by_token``
_LO32, _HI32 = np.uint64(0x00000000FFFFFFFF), np.uint64(0xFFFFFFFF00000000)
_LO16, _HI16 = np.uint64(0x0000FFFF0000FFFF), np.uint64(0xFFFF0000FFFF0000)
_LO8, _HI8 = np.uint64(0x00FF00FF00FF00FF), np.uint64(0xFF00FF00FF00FF00)


@njit
def codes_by_token(zs, rb, n, ct):
    """One head's one-byte codes, ``zs[rb[c] + j]`` (a row per channel, each starting at a
    multiple of 8), token by token into ``ct`` (``[n, D]`` int8 as uint64 words) for ``n``
    tokens (``n`` and ``D`` multiples of 8): 8 channels x 8 tokens at a time, loaded as eight
    64-bit words and transposed by three rounds of swaps of 4, 2 and 1 bytes. A transposing loop
    of single codes does not vectorize; this does eight codes per word operation."""
    d8 = rb.shape[0] // 8
    w = zs[:zs.shape[0] // 8 * 8].view(np.uint64)
    c64 = ct.view(np.uint64)
    r = np.empty(8, np.uint64)
    for c0 in range(0, 8 * d8, 8):
        for j0 in range(0, n, 8):
            for i in range(8):  # word i: tokens j0..j0+7 of channel c0 + i, one byte each
                r[i] = w[(rb[c0 + i] + j0) // 8]
            for i in range(4):
                a, b = r[i], r[i + 4]
                r[i], r[i + 4] = (a & _LO32) | (b << np.uint64(32)), (a >> np.uint64(32)) | (b & _HI32)
            for i in (0, 1, 4, 5):
                a, b = r[i], r[i + 2]
                r[i], r[i + 2] = (a & _LO16) | ((b << np.uint64(16)) & _HI16), ((a >> np.uint64(16)) & _LO16) | (b & _HI16)
            for i in (0, 2, 4, 6):
                a, b = r[i], r[i + 1]
                r[i], r[i + 1] = (a & _LO8) | ((b << np.uint64(8)) & _HI8), ((a >> np.uint64(8)) & _LO8) | (b & _HI8)
            for k in range(8):  # word k: channels c0..c0+7 of token j0 + k
                c64[(j0 + k) * d8 + c0 // 8] = r[k]


@njit
def dequant_rows(zs, slot, t, step, mean, lv, out, lay, tok, cos, sin, ci, z, y, ct, by_token):
    """``out[lay, h, tok + j] = zs[slot[h*D + c] + j] * lv[j] * step + mean``, then RoPE'd
    where ``ci >= 0``. With ``by_token`` (one-byte codes, ``t`` and ``D`` multiples of 8) each
    head's codes are first put token by token (``codes_by_token`` into ``ct``), so that each row
    is computed by a contiguous loop."""
    h_n, d = out.shape[1], out.shape[3]
    half = d // 2
    fast = t if by_token else 0
    cb = ct.view(np.int8)
    for h in range(h_n):
        rb = slot[h * d:(h + 1) * d]
        st = step[h * d:(h + 1) * d]
        mu = mean[h * d:(h + 1) * d]
        hc = h if cos.shape[1] > 1 else 0
        if fast:
            codes_by_token(zs, rb, fast, ct)
        for j in range(t):
            sc = lv[j]
            row = out[lay, h, tok + j]
            if j < fast:
                cj = cb[j * d:(j + 1) * d]
                if ci < 0:
                    for c in range(d):
                        row[c] = np.float32(cj[c]) * sc * st[c] + mu[c]
                    continue
                for c in range(d):
                    z[c] = np.float32(cj[c]) * sc
            else:
                for c in range(d):
                    z[c] = np.float32(zs[rb[c] + j]) * sc
            for c in range(d):
                y[c] = z[c] * st[c] + mu[c]
            if ci >= 0:
                rope_row(row, y, cos[ci, hc, j], sin[ci, hc, j], half)
            else:
                for c in range(d):
                    row[c] = y[c]

@njit
def scaled_rows(zs, slot, t, lv, out, lay):
    """``out[lay, h, c, :t] = zs[slot[h*D + c]:+t] * lv``: a channel's codes scaled by their
    tokens' ``2**-level``, row by row (contiguous on both sides, so the loop vectorizes; the
    caller's matmul reads the rows transposed). The loops index slices from 0: an index
    ``r + j`` would need numba's negative-index check, which keeps LLVM from vectorizing."""
    h_n, d = out.shape[1], out.shape[2]
    for h in range(h_n):
        for c in range(d):
            r = slot[h * d + c]
            src, o = zs[r:r + t], out[lay, h, c, :t]
            for j in range(t):
                o[j] = np.float32(src[j]) * lv[j]

@njit
def rope_row(row, y, cr, sr, half):
    """``row = y * cos + rotate_half(y) * sin``, as ``transforms.rope`` computes it: each
    product rounded, then the sum."""
    for i in range(half):
        a, c2 = y[i], y[i + half]
        row[i] = a * cr[i] + (-c2) * sr[i]
        row[i + half] = c2 * cr[i + half] + a * sr[i + half]

@njit
def frame_size(raw, p, n_frames, f):
    """Frame ``f``'s deflated bytes and peak, from the header of the codes blob at ``raw[p]``."""
    q = p + 2 + 4 * f
    size = np.int64(raw[q]) | (np.int64(raw[q + 1]) << 8) | (np.int64(raw[q + 2]) << 16) | (np.int64(raw[q + 3]) << 24)
    q = p + 2 + 4 * n_frames + 2 * f
    return size, np.int64(raw[q]) | (np.int64(raw[q + 1]) << 8)


@njit
def blob_layout(raw, p, n_raw, bins_b, hd, counts, start, slot):
    """``(error, width, frames)`` of the codes blob at ``raw[p:p + n_raw]`` whose channels fall in
    ``bins_b [H*D]``: its header checked against the bins (0: sound), ``counts[v]`` the channels of
    bin ``v`` and ``slot[c]`` channel ``c``'s row in bin order (``start`` is scratch). Every frame
    size is read as untrusted: they must add up to the blob."""
    width, n_frames = raw[p], raw[p + 1]
    if width != 1 and width != 2 and width != OWN_WIDTHS:
        return ERR_WIDTH, width, n_frames
    counts[:] = 0
    for c in range(hd):
        counts[bins_b[c]] += 1
    n_bins, acc = 0, 0
    for v in range(256):
        start[v] = acc
        acc += counts[v]
        if counts[v] > 0:
            n_bins += 1
    head = 2 + 6 * n_frames
    if n_bins != n_frames or n_raw < head:
        return ERR_FRAMES, width, n_frames
    total, bad = 0, False
    for f in range(n_frames):
        size, peak = frame_size(raw, p, n_frames, f)
        if size >= 2 ** 31 or peak >= 32768:  # (a negative peak)
            bad = True
        total += size
    if bad or head + total != n_raw:
        return ERR_SIZES, width, n_frames
    for c in range(hd):  # channels in bin order, ascending within a bin (a stable sort)
        v = bins_b[c]
        slot[c] = start[v]
        start[v] += 1
    return 0, width, n_frames


@njit
def decode_blobs(raw, c_off, c_len, step, mean, bins, t, lsc, out, layer, tok, plain, cos, sin, cs_idx,
                 tables, scratch, zs8, zs16, state, err):
    """Blob b (one layer of one role of a chunk): its codes at ``raw[c_off[b]:+c_len[b]]``,
    ``step``/``mean``/``bins`` ``[n, H*D]`` from its params, ``lsc [n, t]`` = 2**-level.
    Where ``plain``: ``code * 2**-level * step + mean`` written to
    ``out[layer[b], :, tok:tok + t, :]`` (``[L, H, T, D]``), RoPE'd by ``cos``/``sin[cs_idx[b]]``
    (``[Hc, t, D]``, Hc 1 or H) where ``cs_idx[b] >= 0``. Else ``code * 2**-level`` channel by
    channel to ``out[b, :, :, :t]`` (``[n, H, D, t]``, one row per blob; the caller rotates those
    out of a key basis). Two passes per blob: every frame inflated and unpacked to rows of codes in bin
    order (``zs8``, or ``zs16`` for two-byte codes; a frame of one code per byte inflates
    straight there), then each head's rows dequantized (and RoPE'd) token by token, each cache
    row written once, in order, or scaled channel by channel.
    ``err[b]``: 0 or an error code (nothing of that blob is written)."""
    init(state.ctypes.data)
    h_n = out.shape[1]
    hd = step.shape[1]
    d = hd // h_n
    counts = np.zeros(256, np.int64)
    start = np.zeros(256, np.int64)
    slot = np.zeros(hd, np.int64)  # channel -> its row in bin order
    z = np.zeros(d, np.float32)
    y = np.zeros(d, np.float32)
    ct = np.zeros(t * d // 8 + 1, np.uint64)  # one head's codes token by token (codes_by_token)
    by_token = d % 8 == 0 and t % 8 == 0
    sp, scr, z8 = raw.ctypes.data, scratch.ctypes.data, zs8.ctypes.data
    for b in range(c_off.shape[0]):
        p, n_raw, lay = c_off[b], c_len[b], layer[b]
        e, width, n_frames = blob_layout(raw, p, n_raw, bins[b], hd, counts, start, slot)
        if e != 0:
            err[b] = e
            continue
        head = 2 + 6 * n_frames
        o, pos, fb = 0, p + head, 0
        for f in range(n_frames):
            size, peak = frame_size(raw, p, n_frames, f)
            while counts[fb] == 0:  # the f-th bin that has channels
                fb += 1
            n = counts[fb]
            fb += 1
            per = codes_per_byte(peak)
            m = n * t
            if per == 0:
                if size:
                    err[b] = ERR_ZERO
                    break
                if width == 1:
                    zs8[o * t:(o + n) * t] = 0
                else:
                    zs16[o * t:(o + n) * t] = 0
            elif m > 0:
                fw = frame_width(width, peak)
                n_bytes = (m + per - 1) // per if per > 1 else fw * m
                if per == 1 and width == 1:  # one code per byte: inflated straight into its rows
                    if not inflate_one(state, sp + pos, size, z8 + o * t, n_bytes):
                        err[b] = ERR_INFLATE
                        break
                else:
                    if n_bytes > scratch.shape[0] or not inflate_one(state, sp + pos, size, scr, n_bytes):
                        err[b] = ERR_INFLATE
                        break
                    if width == 1:
                        good = unpack_frame(scratch, n_bytes, fw, per, peak, tables, zs8, o * t, m)
                    else:
                        good = unpack_frame(scratch, n_bytes, fw, per, peak, tables, zs16, o * t, m)
                    if not good:
                        err[b] = ERR_RANGE
                        break
            o += n
            pos += size
        if err[b] != 0:
            continue
        for c in range(hd):
            slot[c] *= t  # (row -> its first code)
        if not plain:  # (the scaled codes of blob b go to out[b])
            if width == 1:
                scaled_rows(zs8, slot, t, lsc[b], out, b)
            else:
                scaled_rows(zs16, slot, t, lsc[b], out, b)
        elif width == 1:
            dequant_rows(zs8, slot, t, step[b], mean[b], lsc[b], out, lay, tok, cos, sin, cs_idx[b], z, y, ct, by_token)
        else:
            dequant_rows(zs16, slot, t, step[b], mean[b], lsc[b], out, lay, tok, cos, sin, cs_idx[b], z, y, ct, False)

@njit
def rope_blobs(src, out, layer, tok, t, step, mean, cos, sin, cs_idx):
    """``out[layer[b], :, tok:tok + t] = src[b, :, :t] * step[b] + mean[b]`` (``step``/``mean``
    ``[n, H*D]``), RoPE'd by ``cos``/``sin[cs_idx[b]]`` (written as they are where ``cs_idx[b] < 0``):
    each row of the cache written once, with ``dequantize_codes``'s arithmetic (the rotated row
    times the step, plus the mean) and ``transforms.rope``'s. ``src`` is not ``out``: the loops
    index both directly (no row copy), so the inner one vectorizes."""
    d = out.shape[3]
    half = d // 2
    y = np.empty(d, np.float32)
    for b in range(layer.shape[0]):
        ci, lay = cs_idx[b], layer[b]
        for h in range(out.shape[1]):
            s2, o2 = src[b, h], out[lay, h]
            st, mu = step[b, h * d:(h + 1) * d], mean[b, h * d:(h + 1) * d]
            if ci < 0:
                for j in range(t):
                    for c in range(d):
                        o2[tok + j, c] = s2[j, c] * st[c] + mu[c]
                continue
            hc = h if cos.shape[1] > 1 else 0
            cr, sr = cos[ci, hc], sin[ci, hc]
            for j in range(t):
                for c in range(d):
                    y[c] = s2[j, c] * st[c] + mu[c]
                for i in range(half):  # transforms.rope's arithmetic: each product rounded, then the sum
                    a, c2 = y[i], y[i + half]
                    o2[tok + j, i] = a * cr[j, i] + (-c2) * sr[j, i]
                    o2[tok + j, i + half] = c2 * cr[j, i + half] + a * sr[j, i + half]

@njit
def inflate_blobs(raw, c_off, c_len, bins, t, u, u_pos, dry, ch_off, ch_first, ch_mode, state, err):
    """A device decode's host part: blob b's code frames (as ``decode_blobs`` reads them) inflated,
    one after another, into ``u`` from ``u_pos`` on, as they are stored (int8, int16 or packed
    digits: unpacked on the device); returns the bytes written. For each channel ``c``:
    ``ch_off[b, c]`` its frame's offset in ``u``, ``ch_first[b, c]`` its first code's index in
    the frame (its row times ``t``), ``ch_mode[b, c]`` = codes per byte | bytes per code << 4 |
    peak << 8 (codes per byte 0: every code 0, nothing stored). Each frame must inflate to
    exactly its bytes and each packed byte hold digits in range, else ``err[b]`` (see
    ``decode_blobs``). ``dry``: headers checked and the bytes counted, nothing inflated."""
    init(state.ctypes.data)
    hd = bins.shape[1]
    counts = np.zeros(256, np.int64)
    start = np.zeros(256, np.int64)
    slot = np.zeros(hd, np.int64)
    frame_at = np.zeros(256, np.int64)
    frame_mode = np.zeros(256, np.int32)
    sp, up = raw.ctypes.data, u.ctypes.data
    o = u_pos
    for b in range(c_off.shape[0]):
        p, n_raw = c_off[b], c_len[b]
        e, width, n_frames = blob_layout(raw, p, n_raw, bins[b], hd, counts, start, slot)
        if e != 0:
            err[b] = e
            continue
        pos, fb = p + 2 + 6 * n_frames, 0
        for f in range(n_frames):
            size, peak = frame_size(raw, p, n_frames, f)
            while counts[fb] == 0:  # the f-th bin that has channels
                fb += 1
            per = codes_per_byte(peak)
            m = counts[fb] * t
            fw = frame_width(width, peak) if per == 1 else 1
            n_bytes = 0 if per == 0 else fw * m if per == 1 else (m + per - 1) // per
            if per == 0 and size:
                err[b] = ERR_ZERO
                break
            if n_bytes and not dry:
                if o + n_bytes > u.shape[0] or not inflate_one(state, sp + pos, size, up + o, n_bytes):
                    err[b] = ERR_INFLATE
                    break
                if per > 1 and not digits_in_range(u[o:o + n_bytes], per, peak):
                    err[b] = ERR_RANGE
                    break
            frame_at[fb] = o
            frame_mode[fb] = per | (fw << 4) | (peak << 8)
            fb += 1
            o += n_bytes
            pos += size
        if err[b] != 0 or dry:
            continue
        for c in range(hd):
            v = bins[b, c]
            ch_off[b, c] = frame_at[v]
            ch_first[b, c] = (slot[c] - (start[v] - counts[v])) * t
            ch_mode[b, c] = frame_mode[v]
    return o - u_pos
