"""The size of an ``ec`` codes blob without deflating it: zlib's Huffman-only deflate, counted.

``coders.deflate.deflate_compress`` (level 6, memLevel 9, ``Z_HUFFMAN_ONLY``) cuts a frame into
blocks of 32767 literals (``lit_bufsize - 1``) and codes each block with the smallest of a
stored, a fixed-Huffman and a dynamic-Huffman block; the dynamic block's length-limited
Huffman code comes from zlib's heap (ties go to the shallower subtree) and its length
adjustment, and the code lengths travel run-length coded. A block's bits are therefore a
function of its byte histogram, and :func:`stream_bytes` follows zlib's steps (``trees.c``:
``build_tree``, ``gen_bitlen``, ``scan_tree``, ``build_bl_tree``, ``_tr_flush_block``) to
count them exactly. :func:`codes_blob_bytes` does it for every frame of a role's codes as
``kdnctl.quant.entropy.encode_codes`` would cut them (``own_widths`` False: what the scale
fit measures), generating each frame's bytes on the fly.

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

njit = functools.partial(numba.njit, nogil=True, cache=True)

L_CODES, D_CODES, BL_CODES = 286, 30, 19
HEAP_SIZE = 2 * L_CODES + 1
MAX_BITS, MAX_BL_BITS = 15, 7
END_BLOCK = 256
BLOCK_LITERALS = 32767  # zlib's lit_bufsize - 1 at memLevel 9
BL_ORDER = np.array([16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15], np.int64)
EXTRA_BL = np.array([0] * 16 + [2, 3, 7], np.int64)
NO_EXTRA = np.zeros(D_CODES, np.int64)  # (no lengths or distances in Huffman-only blocks)
STATIC_L = np.array([8] * 144 + [9] * 112 + [7] * 24 + [8] * 8, np.int64)
STATIC_D = np.full(D_CODES, 5, np.int64)

codes_per_byte = njit(digits.codes_per_byte)


@njit
def _build_tree(freq, dl, depth, heap, bl_count, elems, slen, extra, base, max_length, has_static):
    """zlib's build_tree and gen_bitlen: the leaves' code lengths in ``dl`` (zlib's Dad/Len
    union: a node's parent until its length replaces it). The heap steps are written out in
    place: a compiled call passing the arrays costs more than a step. Returns (max_code, the tree's share of
    opt_len, of static_len)."""
    opt = 0
    stat = 0
    heap_len = 0
    heap_max = HEAP_SIZE
    max_code = -1
    for n in range(elems):
        if freq[n] != 0:
            heap_len += 1
            heap[heap_len] = n
            max_code = n
            depth[n] = 0
        else:
            dl[n] = 0
    while heap_len < 2:  # at least two codes, each of at least one bit
        if max_code < 2:
            max_code += 1
            node = max_code
        else:
            node = 0
        heap_len += 1
        heap[heap_len] = node
        freq[node] = 1
        depth[node] = 0
        opt -= 1
        if has_static:
            stat -= slen[node]
    for n in range(heap_len // 2, 0, -1):
        # pqdownheap from n (``smaller``: the lower frequency, ties to the shallower subtree)
        k = n
        v = heap[k]
        fv, dv = freq[v], depth[v]
        j = k << 1
        while j <= heap_len:
            if j < heap_len:
                x, y = heap[j + 1], heap[j]
                if freq[x] < freq[y] or (freq[x] == freq[y] and depth[x] <= depth[y]):
                    j += 1
            w = heap[j]
            if fv < freq[w] or (fv == freq[w] and dv <= depth[w]):
                break
            heap[k] = w
            k = j
            j <<= 1
        heap[k] = v
    node = elems
    while True:
        n = heap[1]
        heap[1] = heap[heap_len]
        heap_len -= 1
        # pqdownheap from 1 (``smaller``: the lower frequency, ties to the shallower subtree)
        k = 1
        v = heap[k]
        fv, dv = freq[v], depth[v]
        j = k << 1
        while j <= heap_len:
            if j < heap_len:
                x, y = heap[j + 1], heap[j]
                if freq[x] < freq[y] or (freq[x] == freq[y] and depth[x] <= depth[y]):
                    j += 1
            w = heap[j]
            if fv < freq[w] or (fv == freq[w] and dv <= depth[w]):
                break
            heap[k] = w
            k = j
            j <<= 1
        heap[k] = v
        m = heap[1]
        heap_max -= 1
        heap[heap_max] = n
        heap_max -= 1
        heap[heap_max] = m
        freq[node] = freq[n] + freq[m]
        depth[node] = (depth[n] if depth[n] >= depth[m] else depth[m]) + 1
        dl[n] = node
        dl[m] = node
        heap[1] = node
        node += 1
        # pqdownheap from 1 (``smaller``: the lower frequency, ties to the shallower subtree)
        k = 1
        v = heap[k]
        fv, dv = freq[v], depth[v]
        j = k << 1
        while j <= heap_len:
            if j < heap_len:
                x, y = heap[j + 1], heap[j]
                if freq[x] < freq[y] or (freq[x] == freq[y] and depth[x] <= depth[y]):
                    j += 1
            w = heap[j]
            if fv < freq[w] or (fv == freq[w] and dv <= depth[w]):
                break
            heap[k] = w
            k = j
            j <<= 1
        heap[k] = v
        if heap_len < 2:
            break
    heap_max -= 1
    heap[heap_max] = heap[1]
    # gen_bitlen
    for b in range(MAX_BITS + 1):
        bl_count[b] = 0
    dl[heap[heap_max]] = 0
    overflow = 0
    h = heap_max + 1
    while h < HEAP_SIZE:
        n = heap[h]
        bits = dl[dl[n]] + 1
        if bits > max_length:
            bits = max_length
            overflow += 1
        dl[n] = bits
        if n <= max_code:
            bl_count[bits] += 1
            xbits = extra[n - base] if n >= base else 0
            f = freq[n]
            opt += f * (bits + xbits)
            if has_static:
                stat += f * (slen[n] + xbits)
        h += 1
    if overflow > 0:
        while True:
            bits = max_length - 1
            while bl_count[bits] == 0:
                bits -= 1
            bl_count[bits] -= 1
            bl_count[bits + 1] += 2
            bl_count[max_length] -= 1
            overflow -= 2
            if overflow <= 0:
                break
        h = HEAP_SIZE
        bits = max_length
        while bits != 0:
            n = bl_count[bits]
            while n != 0:
                h -= 1
                m = heap[h]
                if m > max_code:
                    continue
                if dl[m] != bits:
                    opt += (bits - dl[m]) * freq[m]
                    dl[m] = bits
                n -= 1
            bits -= 1
    return max_code, opt, stat


@njit
def _scan_tree(dl, max_code, bl_freq):
    """zlib's scan_tree: the code-length code's symbol counts for one tree's lengths."""
    prevlen = -1
    nextlen = dl[0]
    count = 0
    max_count, min_count = 7, 4
    if nextlen == 0:
        max_count, min_count = 138, 3
    for n in range(max_code + 1):
        curlen = nextlen
        nextlen = dl[n + 1] if n + 1 <= max_code else 0xFFFF  # zlib's guard
        count += 1
        if count < max_count and curlen == nextlen:
            continue
        elif count < min_count:
            bl_freq[curlen] += count
        elif curlen != 0:
            if curlen != prevlen:
                bl_freq[curlen] += 1
            bl_freq[16] += 1
        elif count <= 10:
            bl_freq[17] += 1
        else:
            bl_freq[18] += 1
        count = 0
        prevlen = curlen
        if nextlen == 0:
            max_count, min_count = 138, 3
        elif curlen == nextlen:
            max_count, min_count = 6, 3
        else:
            max_count, min_count = 7, 4


@njit
def _block_bits(hist, n_lit, work, bitpos):
    """The bit position after one block of ``n_lit`` literals with byte histogram ``hist``
    written at ``bitpos`` (a stored block aligns to a byte)."""
    fl, dll, fd, dld, fb, dlb, depth, heap, bl_count = work
    for i in range(HEAP_SIZE):
        fl[i] = 0
        fd[i] = 0
        fb[i] = 0
    for i in range(256):
        fl[i] = hist[i]
    fl[END_BLOCK] = 1
    ml, o1, s1 = _build_tree(fl, dll, depth, heap, bl_count, L_CODES, STATIC_L, NO_EXTRA, 257, MAX_BITS, True)
    md, o2, s2 = _build_tree(fd, dld, depth, heap, bl_count, D_CODES, STATIC_D, NO_EXTRA, 0, MAX_BITS, True)
    _scan_tree(dll, ml, fb)
    _scan_tree(dld, md, fb)
    _mb, o3, _s3 = _build_tree(fb, dlb, depth, heap, bl_count, BL_CODES, STATIC_D, EXTRA_BL, 0, MAX_BL_BITS, False)
    max_blindex = BL_CODES - 1
    while max_blindex >= 3:
        if dlb[BL_ORDER[max_blindex]] != 0:
            break
        max_blindex -= 1
    opt = o1 + o2 + o3 + 3 * (max_blindex + 1) + 5 + 5 + 4
    stat = s1 + s2
    opt_lenb = (opt + 3 + 7) >> 3
    static_lenb = (stat + 3 + 7) >> 3
    if static_lenb <= opt_lenb:
        opt_lenb = static_lenb
    if n_lit + 4 <= opt_lenb:  # stored: the type bits, to the next byte, LEN and NLEN, the bytes
        return ((bitpos + 3 + 7) // 8) * 8 + 32 + 8 * n_lit
    if static_lenb == opt_lenb:
        return bitpos + 3 + stat
    return bitpos + 3 + opt


@njit
def new_work():
    return (np.zeros(HEAP_SIZE, np.int64), np.zeros(HEAP_SIZE, np.int64), np.zeros(HEAP_SIZE, np.int64),
            np.zeros(HEAP_SIZE, np.int64), np.zeros(HEAP_SIZE, np.int64), np.zeros(HEAP_SIZE, np.int64),
            np.zeros(HEAP_SIZE, np.int64), np.zeros(HEAP_SIZE + 1, np.int64), np.zeros(MAX_BITS + 2, np.int64))


@njit
def _close(hist, n, bitpos, work):
    """The bytes of a stream whose open block (``n`` literals, byte histogram ``hist``) is its
    last (empty where the stream filled its last block exactly); ``hist`` is cleared."""
    bits = _block_bits(hist, n, work, bitpos)
    hist[:] = 0
    return (bits + 7) // 8


# The literal loops below keep the open block in locals and call ``_block_bits`` only when a
# block fills (zlib flushes at 32767 literals): a call per literal would pass the work arrays
# (and their reference counts) per byte, several times the cost of counting it.

@njit
def stream_bytes(data):
    """``len(deflate_compress(data))`` for a non-empty uint8 array ``data``."""
    work = new_work()
    hist = np.zeros(256, np.int64)
    n = bitpos = 0
    for i in range(data.shape[0]):
        hist[data[i]] += 1
        n += 1
        if n == BLOCK_LITERALS:
            bitpos = _block_bits(hist, n, work, bitpos)
            hist[:] = 0
            n = 0
    return _close(hist, n, bitpos, work)


@njit
def _add_block(hist, n, work, bitpos):
    """A full block closed: the stream's bit position after it (``hist`` cleared)."""
    bitpos = _block_bits(hist, n, work, bitpos)
    hist[:] = 0
    return bitpos


@njit
def codes_blob_bytes(codes, bins, row_peak):
    """``len`` of ``encode_codes(codes, "deflate", own_widths=False)``'s blob, for integer
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
        n_bytes = (m * t + per - 1) // per if per > 1 else m * t * width
        if n_bytes < BLOCK_LITERALS:  # one block (most frames): no block check per byte
            _frame_hist(rows, members, m, t, per, peak, width, hist)
            total += _close(hist, n_bytes, 0, work)
        else:
            total += _frame_blocks(rows, members, m, t, per, peak, width, hist, work)
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
                    bitpos = _add_block(hist, n, work, bitpos)
                    n = 0
    if k > 0:
        hist[acc] += 1
        n += 1
        if n == BLOCK_LITERALS:
            bitpos = _add_block(hist, n, work, bitpos)
            n = 0
    return _close(hist, n, bitpos, work)


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
