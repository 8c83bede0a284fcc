"""zlib's Huffman-only deflate, counted: the bytes of a stream from its byte histograms.

``coders.deflate.deflate_compress`` (level 6, memLevel 9, ``Z_HUFFMAN_ONLY``) cuts a stream into
blocks of 32767 literals (``lit_bufsize - 1``) and codes each block with the smallest of a
stored, a fixed-Huffman and a dynamic-Huffman block; the dynamic block's length-limited Huffman
code comes from zlib's heap (ties go to the shallower subtree) and its length adjustment, and the
code lengths travel run-length coded. A block's bits are therefore a function of its byte
histogram, and :func:`block_bits` follows zlib's steps (``trees.c``: ``build_tree``,
``gen_bitlen``, ``scan_tree``, ``build_bl_tree``, ``_tr_flush_block``) to count them exactly.
The reference is zlib itself (``tests/test_deflate_size.py``).
"""

from __future__ import annotations

import functools

import numba
import numpy as np

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


REP_3_6, REPZ_3_10, REPZ_11_138 = 16, 17, 18  # the code-length code's run symbols


@njit
def tree_runs(dl, max_code, bl_freq, syms, extras, k):
    """zlib's walk over one tree's code lengths (``scan_tree`` counts it, ``send_tree`` sends it):
    each code-length code symbol counted in ``bl_freq`` and, where ``syms`` has room, recorded at
    ``syms[k]`` with its extra bits' value at ``extras[k]``. Returns ``k`` after the last."""
    record = syms.shape[0] > 0
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
            if record:
                for _ in range(count):
                    syms[k], extras[k] = curlen, 0
                    k += 1
        else:
            if curlen != 0:
                sym, extra = REP_3_6, count - 3
                if curlen != prevlen:
                    bl_freq[curlen] += 1
                    extra -= 1  # (send_tree sends the length once, then repeats it count - 1 times)
                    if record:
                        syms[k], extras[k] = curlen, 0
                        k += 1
            elif count <= 10:
                sym, extra = REPZ_3_10, count - 3
            else:
                sym, extra = REPZ_11_138, count - 11
            bl_freq[sym] += 1
            if record:
                syms[k], extras[k] = sym, extra
                k += 1
        count = 0
        prevlen = curlen
        if nextlen == 0:
            max_count, min_count = 138, 3
        elif curlen == nextlen:
            max_count, min_count = 6, 3
        else:
            max_count, min_count = 7, 4
    return k


STORED, STATIC, DYNAMIC = 0, 1, 2  # a block's kind, as zlib chooses it


@njit
def block_plan(hist, n_lit, work):
    """zlib's ``_tr_flush_block`` choice for one block of ``n_lit`` literals with byte histogram
    ``hist``: ``(kind, bits after the block's 3 type bits (not for a stored block), the literal
    tree's max code, the distance tree's, the last code-length code sent)``. The dynamic trees'
    code lengths are left in ``work`` (``dll``, ``dld``, ``dlb``): what an encoder writes."""
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
    none = np.empty(0, np.int64)  # (counted, not recorded)
    tree_runs(dll, ml, fb, none, none, 0)
    tree_runs(dld, md, fb, none, none, 0)
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
    if n_lit + 4 <= opt_lenb:
        return STORED, 0, ml, md, max_blindex
    if static_lenb == opt_lenb:
        return STATIC, stat, ml, md, max_blindex
    return DYNAMIC, opt, ml, md, max_blindex


@njit
def block_bits(hist, n_lit, work, bitpos):
    """The bit position after one block of ``n_lit`` literals with byte histogram ``hist``
    written at ``bitpos`` (a stored block aligns to a byte)."""
    kind, bits, _ml, _md, _mb = block_plan(hist, n_lit, work)
    if kind == STORED:  # the type bits, to the next byte, LEN and NLEN, the bytes
        return ((bitpos + 3 + 7) // 8) * 8 + 32 + 8 * n_lit
    return bitpos + 3 + bits


@njit
def new_work():
    """The arrays :func:`block_bits` builds its three trees in (zlib's per-stream state)."""
    return (np.zeros(HEAP_SIZE, np.int64), np.zeros(HEAP_SIZE, np.int64), np.zeros(HEAP_SIZE, np.int64),
            np.zeros(HEAP_SIZE, np.int64), np.zeros(HEAP_SIZE, np.int64), np.zeros(HEAP_SIZE, np.int64),
            np.zeros(HEAP_SIZE, np.int64), np.zeros(HEAP_SIZE + 1, np.int64), np.zeros(MAX_BITS + 2, np.int64))


@njit
def close_stream(hist, n, bitpos, work):
    """The bytes of a stream whose open block (``n`` literals, byte histogram ``hist``) is its
    last (empty where the stream filled its last block exactly); ``hist`` is cleared."""
    bits = block_bits(hist, n, work, bitpos)
    hist[:] = 0
    return (bits + 7) // 8


@njit
def close_block(hist, n, work, bitpos):
    """A full block closed: the stream's bit position after it (``hist`` cleared)."""
    bitpos = block_bits(hist, n, work, bitpos)
    hist[:] = 0
    return bitpos


# The literal loops (here and in ``deflate_size``) keep the open block in locals and call
# ``block_bits`` only when a block fills (zlib flushes at 32767 literals): a call per literal
# would pass the work arrays (and their reference counts) per byte, several times its cost.


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
            bitpos = close_block(hist, n, work, bitpos)
            n = 0
    return close_stream(hist, n, bitpos, work)
