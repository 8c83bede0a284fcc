"""Compiled (numba) kernels that decode ec roles on the CPU; ``reference`` is the spec.

Both kernels release the GIL, so a loader runs chunks on both cores with plain threads (no
second thread pool beside torch's). The frames are inflated by ISA-L's stateless inflate,
called straight from the compiled loop (the library python-isal ships; bound by name once per
process): no Python per frame. A frame must decode to exactly the bytes its header implies and
consume exactly its bytes, as ``entropy.deflate_decompress`` demands.

``isal_inflate_stateless`` reads and writes the first fields of ISA-L's ``struct inflate_state``:
``next_out`` (offset 0), ``avail_out`` (8), ``next_in`` (16), ``avail_in`` (32); these have kept
their place in every ISA-L release, and :func:`available` decodes a known frame before anything
relies on them.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np

STATE_BYTES = 1 << 18  # > sizeof(struct inflate_state) (~80 KB in ISA-L 2.31), a margin for others

# error codes of decode_blobs, per blob (0: decoded)
ERR_WIDTH, ERR_FRAMES, ERR_SIZES, ERR_INFLATE, ERR_RANGE, ERR_ZERO = 1, 2, 3, 4, 5, 6
MESSAGES = {
    ERR_WIDTH: "codes has an unknown code width",
    ERR_FRAMES: "codes holds a number of frames its bins do not need",
    ERR_SIZES: "codes: its frame sizes do not add up",
    ERR_INFLATE: "codes: a frame is not a valid deflate stream of exactly the bytes it needs",
    ERR_RANGE: "packed codes out of range",
    ERR_ZERO: "codes: an all-zero frame holds bytes",
}


@functools.lru_cache(maxsize=1)
def _kernels():
    """(inflate_frames, decode_blobs, rope_blobs), compiled (or loaded from numba's cache) once; None where
    numba or the ISA-L library is missing."""
    try:
        import llvmlite.binding as llb
        import numba
        from isal import isal_zlib
        from numba import types
    except ImportError:
        return None
    llb.load_library_permanently(isal_zlib.__file__)
    init = types.ExternalFunction("isal_inflate_init", types.void(types.voidptr))
    stateless = types.ExternalFunction("isal_inflate_stateless", types.int32(types.voidptr))
    return _build(numba, init, stateless)


def _build(numba, init, stateless):
    njit = functools.partial(numba.njit, nogil=True, cache=True)

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

    @njit
    def codes_per_byte(peak):
        if peak == 0:
            return 0
        radix, per = 2 * peak + 1, 1
        while radix ** (per + 1) <= 256:
            per += 1
        return per

    @njit
    def rope_rows(out, lay, tok, t, cos, sin, ci):
        """RoPE in place on ``out[lay, :, tok:tok + t]`` (rotate-half), as ``transforms.rope``
        computes it: ``x * cos + rotate_half(x) * sin``, each product rounded, then the sum."""
        d = out.shape[3]
        half = d // 2
        y = np.zeros(d, np.float32)
        for h in range(out.shape[1]):
            hc = h if cos.shape[1] > 1 else 0
            for j in range(t):
                row = out[lay, h, tok + j]
                cr, sr = cos[ci, hc, j], sin[ci, hc, j]
                for i in range(half):
                    a, c2 = row[i], row[i + half]
                    y[i] = a * cr[i] + (-c2) * sr[i]
                    y[i + half] = c2 * cr[i + half] + a * sr[i + half]
                for i in range(d):
                    row[i] = y[i]

    @njit
    def decode_blobs(raw, c_off, c_len, step, mean, bins, t, lsc, out, layer, tok, plain,
                     cos, sin, cs_idx, tables, scratch, state, err):
        """Blob b (one layer of one role of a chunk): its codes at ``raw[c_off[b]:+c_len[b]]``,
        ``step``/``mean``/``bins`` ``[n, H*D]`` from its params, ``lsc [n, t]`` = 2**-level,
        written to ``out[layer[b], :, tok:tok + t, :]``: ``code * 2**-level * step + mean``
        where ``plain``, else ``code * 2**-level`` (the caller rotates those out of a key
        basis); ``cs_idx[b] >= 0``: RoPE by ``cos``/``sin[cs_idx[b]]`` (``[Hc, t, D]``, Hc 1 or H)
        after dequantizing. ``err[b]``: 0 or an error code."""
        init(state.ctypes.data)
        d = out.shape[3]
        hd = out.shape[1] * d
        counts = np.zeros(256, np.int64)
        start = np.zeros(256, np.int64)
        order = np.zeros(hd, np.int64)
        sp, scr = raw.ctypes.data, scratch.ctypes.data
        for b in range(c_off.shape[0]):
            p, n_raw, lay = c_off[b], c_len[b], layer[b]
            width, n_frames = raw[p], raw[p + 1]
            if width != 1 and width != 2:
                err[b] = ERR_WIDTH
                continue
            counts[:] = 0
            for c in range(hd):
                counts[bins[b, c]] += 1
            n_bins, acc = 0, 0
            for v in range(256):
                start[v] = acc
                acc += counts[v]
                if counts[v] > 0:
                    n_bins += 1
            head = 2 + 6 * n_frames
            if n_bins != n_frames or n_raw < head:
                err[b] = ERR_FRAMES
                continue
            total, bad = 0, False
            for f in range(n_frames):
                q = p + 2 + 4 * f
                size = np.int64(raw[q]) | (np.int64(raw[q + 1]) << 8) | (np.int64(raw[q + 2]) << 16) | (np.int64(raw[q + 3]) << 24)
                if size >= 2 ** 31:
                    bad = True
                q = p + 2 + 4 * n_frames + 2 * f
                if raw[q + 1] >= 128:  # a negative peak
                    bad = True
                total += size
            if bad or head + total != n_raw:
                err[b] = ERR_SIZES
                continue
            for c in range(hd):  # channels in bin order, ascending within a bin (a stable sort)
                v = bins[b, c]
                order[start[v]] = c
                start[v] += 1
            lv = lsc[b]
            o, pos = 0, p + head
            for f in range(n_frames):
                q = p + 2 + 4 * f
                size = np.int64(raw[q]) | (np.int64(raw[q + 1]) << 8) | (np.int64(raw[q + 2]) << 16) | (np.int64(raw[q + 3]) << 24)
                q = p + 2 + 4 * n_frames + 2 * f
                peak = np.int64(raw[q]) | (np.int64(raw[q + 1]) << 8)
                n = counts[bins[b, order[o]]]  # the f-th bin that has channels
                per = codes_per_byte(peak)
                m = n * t
                if per == 0:
                    if size:
                        err[b] = ERR_ZERO
                        break
                elif m > 0:
                    n_bytes = (m + per - 1) // per if per > 1 else width * m
                    if n_bytes > scratch.shape[0] or not inflate_one(state, sp + pos, size, scr, n_bytes):
                        err[b] = ERR_INFLATE
                        break
                    if per > 1:
                        radix, lim = 2 * peak + 1, 1
                        for _ in range(per):
                            lim *= radix
                        top = 0
                        for i in range(n_bytes):
                            if scratch[i] > top:
                                top = scratch[i]
                        if top >= lim:
                            err[b] = ERR_RANGE
                            break
                for r in range(n):
                    ch = order[o + r]
                    col = out[lay, ch // d, tok:tok + t, ch % d]
                    st, mu = step[b, ch], mean[b, ch]
                    if not plain:
                        st, mu = np.float32(1.0), np.float32(0.0)
                    if per == 0 or m == 0:
                        for j in range(t):
                            z = np.float32(0.0) * lv[j]
                            col[j] = z * st + mu if plain else z
                    elif per == 1 and width == 1:
                        k = r * t
                        for j in range(t):
                            v = np.int32(scratch[k + j])
                            z = np.float32(v - 256 if v >= 128 else v) * lv[j]
                            col[j] = z * st + mu if plain else z
                    elif per == 1:
                        k = 2 * r * t
                        for j in range(t):
                            v = np.int32(scratch[k + 2 * j]) | (np.int32(scratch[k + 2 * j + 1]) << 8)
                            z = np.float32(v - 65536 if v >= 32768 else v) * lv[j]
                            col[j] = z * st + mu if plain else z
                    else:
                        tab = tables[peak]
                        k0 = r * t
                        bi = k0 // per
                        di = k0 - bi * per
                        for j in range(t):
                            z = np.float32(tab[scratch[bi], di]) * lv[j]
                            col[j] = z * st + mu if plain else z
                            di += 1
                            if di == per:
                                di = 0
                                bi += 1
                o += n
                pos += size
            if err[b] == 0 and cs_idx[b] >= 0:
                rope_rows(out, lay, tok, t, cos, sin, cs_idx[b])

    @njit
    def rope_blobs(out, layer, tok, t, cos, sin, cs_idx):
        for b in range(layer.shape[0]):
            if cs_idx[b] >= 0:
                rope_rows(out, layer[b], tok, t, cos, sin, cs_idx[b])

    return inflate_frames, decode_blobs, rope_blobs


@functools.lru_cache(maxsize=1)
def digit_tables() -> np.ndarray:
    """int8 ``[8, 256, 5]``: digit ``k`` (least significant first) of byte ``b`` at peak ``p``
    (codes in ``[-p, p]`` as base-``2p+1`` digits), for the peaks that pack (1 to 7)."""
    out = np.zeros((8, 256, 5), np.int8)
    for p in range(1, 8):
        radix = 2 * p + 1
        out[p] = (np.arange(256)[:, None] // radix ** np.arange(5)) % radix - p
    return out


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """The kernels compile and ISA-L's inflate, bound by its first fields, decodes a known
    frame exactly (else loads take the reference path)."""
    k = _kernels()
    if k is None:
        return False
    data = bytes(range(256)) * 37
    z = zlib.compressobj(6, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    frame = np.frombuffer(z.compress(data) + z.flush(), np.uint8)
    dst = np.zeros(len(data), np.uint8)
    ok = np.zeros(2, np.bool_)
    k[0](frame, np.array([0, 0], np.int64), np.array([len(frame), len(frame) - 1], np.int64),
         dst, np.array([0, 0], np.int64), np.array([len(data), len(data)], np.int64), new_state(), ok)
    return bool(ok[0]) and not bool(ok[1]) and dst.tobytes() == data


def new_state() -> np.ndarray:
    return np.zeros(STATE_BYTES, np.uint8)


def kernels():
    return _kernels()
