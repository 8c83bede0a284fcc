"""zlib's Huffman-only deflate, compiled: the bytes ``coders.deflate.deflate_compress`` writes for
a code frame (level 6, memLevel 9, ``Z_HUFFMAN_ONLY``, raw), for every frame of a blob in one call.

A version's encode deflates every code frame of every (chunk, layer, role) blob; zlib, a
stream set up per frame, takes ~8.8 ns a byte on a compress's frames (this: ~4,
``research/probes/huffman_writer_frames.py``). A Huffman-only stream is a function
of its literals alone: blocks of 32767 literals, each stored, fixed-Huffman or dynamic-Huffman
by zlib's own rule, its trees zlib's. :mod:`.zlib_blocks` already follows those steps to count a
block's bits (``block_plan``: the kind and the code lengths); this writes them: the canonical
codes (zlib's ``gen_codes``), the dynamic header (``send_all_trees``, ``send_tree``), the
literals and the end-of-block code, LSB first, and a stored block as ``_tr_stored_block`` does.
The reference is zlib itself: ``tests/test_huffman_only.py`` holds these bytes to
``deflate_compress``'s, byte for byte, on every kind of block.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

from .zlib_blocks import (BL_CODES, BL_ORDER, BLOCK_LITERALS, END_BLOCK, EXTRA_BL, L_CODES, MAX_BITS, REP_3_6,
                          STATIC_L, STORED, STATIC, block_plan, new_work, tree_runs)

njit = functools.partial(numba.njit, nogil=True, cache=True)

REVERSED = np.array([int(f"{v:08b}"[::-1], 2) for v in range(256)], np.int64)  # each byte's bits reversed


@njit
def gen_codes(lengths, max_code, codes):
    """zlib's ``gen_codes``: canonical codes of ``lengths[0:max_code + 1]`` into ``codes``, bit
    reversed (deflate sends a Huffman code's most significant bit first, in an LSB-first stream)."""
    bl_count = np.zeros(MAX_BITS + 1, np.int64)
    for n in range(max_code + 1):
        bl_count[lengths[n]] += 1
    bl_count[0] = 0
    next_code = np.zeros(MAX_BITS + 1, np.int64)
    code = 0
    for bits in range(1, MAX_BITS + 1):
        code = (code + bl_count[bits - 1]) << 1
        next_code[bits] = code
    for n in range(max_code + 1):
        ln = lengths[n]
        if ln == 0:
            continue
        c = next_code[ln]
        next_code[ln] += 1
        codes[n] = ((REVERSED[c & 255] << 8) | REVERSED[(c >> 8) & 255]) >> (16 - ln)


@njit
def static_codes():
    """(codes, lengths) of zlib's fixed literal/length tree (288 codes)."""
    lengths = np.zeros(L_CODES + 2, np.int64)
    lengths[:STATIC_L.shape[0]] = STATIC_L
    codes = np.zeros(L_CODES + 2, np.int64)
    gen_codes(lengths, L_CODES + 1, codes)
    return codes, lengths


@njit
def _flush(out, op, bb, bn):
    """Whole bytes of the bit buffer out: (op, bb, bn)."""
    while bn >= 8:
        out[op] = bb & 255
        op += 1
        bb >>= 8
        bn -= 8
    return op, bb, bn


@njit
def _send_trees(dll, ml, dld, md, bl_code, bl_len, runs, out, op, bb, bn):
    """zlib's ``send_tree`` of the literal and distance trees: their code lengths as the runs
    ``zlib_blocks.tree_runs`` walks (and the plan counted), each by the code-length code."""
    syms, extras, unused = runs
    k = tree_runs(dll, ml, unused, syms, extras, 0)
    k = tree_runs(dld, md, unused, syms, extras, k)
    for j in range(k):
        s = syms[j]
        bb |= bl_code[s] << bn
        bn += bl_len[s]
        if s >= REP_3_6:
            bb |= extras[j] << bn
            bn += EXTRA_BL[s]
        op, bb, bn = _flush(out, op, bb, bn)
    return op, bb, bn


@njit
def _literals(data, a, b, code, length, packed, out, op, bb, bn):
    """``data[a:b]`` and the end-of-block code, each by its code; the buffer is emptied four bytes
    at a time (at most 31 + 30 bits are held). ``packed``: each code with its length above it
    (one load per literal)."""
    for v in range(256):
        packed[v] = code[v] | (length[v] << 32)
    b2 = a + (b - a) // 2 * 2
    for i in range(a, b2, 2):  # two literals joined first (at most 30 bits): half the chain on bn
        e0, e1 = packed[data[i]], packed[data[i + 1]]
        l0 = e0 >> 32
        bb |= ((e0 & 0xFFFFFFFF) | ((e1 & 0xFFFFFFFF) << l0)) << bn
        bn += l0 + (e1 >> 32)
        # the low four bytes stored every time, kept where 32 bits were full (no branch to mispredict)
        out[op] = bb & 255
        out[op + 1] = (bb >> 8) & 255
        out[op + 2] = (bb >> 16) & 255
        out[op + 3] = (bb >> 24) & 255
        full = bn >> 5
        op += 4 * full
        bb >>= 32 * full
        bn -= 32 * full
    if b2 < b:  # an odd last literal (at most 31 + 15 bits: _flush below empties them)
        e = packed[data[b2]]
        bb |= (e & 0xFFFFFFFF) << bn
        bn += e >> 32
        op, bb, bn = _flush(out, op, bb, bn)
    bb |= code[END_BLOCK] << bn
    bn += length[END_BLOCK]
    return _flush(out, op, bb, bn)


@njit
def _block(data, a, b, last, work, hist, dyn, stat, out, op, bb, bn):
    """One block of ``data[a:b]`` (``hist``: its byte histogram) as zlib's ``_tr_flush_block``
    writes it: (op, bb, bn) after it."""
    l_code, l_len, bl_code, bl_len, packed, runs = dyn
    kind, _bits, ml, md, max_blindex = block_plan(hist, b - a, work)
    bb |= ((kind << 1) + last) << bn
    bn += 3
    if kind == STORED:  # to the next byte, LEN, NLEN, the bytes
        op, bb, bn = _flush(out, op, bb, bn)
        if bn > 0:
            out[op] = bb & 255
            op += 1
        bb = 0
        bn = 0
        n = b - a
        out[op] = n & 255
        out[op + 1] = (n >> 8) & 255
        out[op + 2] = (~n) & 255
        out[op + 3] = ((~n) >> 8) & 255
        op += 4
        out[op:op + n] = data[a:b]
        return op + n, bb, bn
    if kind == STATIC:
        return _literals(data, a, b, stat[0], stat[1], packed, out, op, bb, bn)
    _fl, dll, _fd, dld, _fb, dlb, _depth, _heap, _blc = work
    l_len[:] = 0
    l_len[:ml + 1] = dll[:ml + 1]
    gen_codes(l_len, ml, l_code)
    bl_len[:] = dlb[:BL_CODES]
    gen_codes(bl_len, BL_CODES - 1, bl_code)
    bb |= (ml + 1 - 257) << bn
    bn += 5
    bb |= md << bn
    bn += 5
    bb |= (max_blindex + 1 - 4) << bn
    bn += 4
    op, bb, bn = _flush(out, op, bb, bn)
    for rank in range(max_blindex + 1):
        bb |= bl_len[BL_ORDER[rank]] << bn
        bn += 3
        op, bb, bn = _flush(out, op, bb, bn)
    op, bb, bn = _send_trees(dll, ml, dld, md, bl_code, bl_len, runs, out, op, bb, bn)
    return _literals(data, a, b, l_code, l_len, packed, out, op, bb, bn)


@njit
def _histogram(data, a, b, hist, hist4):
    """``hist``: the byte histogram of ``data[a:b]``, counted in four (a byte repeated does not
    wait on one counter)."""
    hist4[:] = 0
    n4 = a + (b - a) // 4 * 4
    for i in range(a, n4, 4):
        hist4[0, data[i]] += 1
        hist4[1, data[i + 1]] += 1
        hist4[2, data[i + 2]] += 1
        hist4[3, data[i + 3]] += 1
    for i in range(n4, b):
        hist4[0, data[i]] += 1
    for v in range(256):
        hist[v] = hist4[0, v] + hist4[1, v] + hist4[2, v] + hist4[3, v]


@njit
def deflate_stream(data, a, b, out, op, work, hist, hist4, dyn, stat):
    """``deflate_compress(data[a:b])`` written at ``out[op]``; returns the end. Blocks of
    ``BLOCK_LITERALS``, and a last one (empty where the literals filled their last block)."""
    bb = 0
    bn = 0
    while True:
        e = a + BLOCK_LITERALS if b - a >= BLOCK_LITERALS else b
        _histogram(data, a, e, hist, hist4)
        last = 1 if e - a < BLOCK_LITERALS else 0
        op, bb, bn = _block(data, a, e, last, work, hist, dyn, stat, out, op, bb, bn)
        a = e
        if last:
            break
    while bn > 0:  # zlib's bi_windup: the last bits, padded to a byte
        out[op] = bb & 255
        op += 1
        bb >>= 8
        bn -= 8
    return op


@njit
def _dynamic_scratch():
    """A dynamic block's codes and lengths (literal and code-length trees), the literal loop's
    packed table, and the trees' runs (``tree_runs``: symbols, extra bits, a count nobody reads)."""
    runs = (np.zeros(2 * L_CODES, np.int64), np.zeros(2 * L_CODES, np.int64), np.zeros(BL_CODES, np.int64))
    return (np.zeros(L_CODES + 2, np.int64), np.zeros(L_CODES + 2, np.int64), np.zeros(BL_CODES, np.int64),
            np.zeros(BL_CODES, np.int64), np.zeros(256, np.int64), runs)


@njit
def stream_bound(n):
    """At most the bytes of a stream of ``n`` literals: zlib stores a block rather than grow it."""
    return n + 5 * (n // BLOCK_LITERALS + 1) + 12  # (+4: the literal loop stores four bytes ahead)


@njit
def deflate_frames(buf, offsets):
    """``(out, ends)``: frame ``f`` (``buf[offsets[f]:offsets[f + 1]]``) deflated to
    ``out[ends[f - 1]:ends[f]]`` (``ends[-1]``: 0), an empty frame to no bytes (as the blob
    stores it)."""
    n_frames = offsets.shape[0] - 1
    total = 0
    for f in range(n_frames):
        total += stream_bound(offsets[f + 1] - offsets[f])
    out = np.empty(total, np.uint8)
    ends = np.zeros(n_frames, np.int64)
    work = new_work()
    hist, hist4 = np.zeros(256, np.int64), np.zeros((4, 256), np.int64)
    dyn = _dynamic_scratch()
    stat = static_codes()
    op = 0
    for f in range(n_frames):
        if offsets[f + 1] > offsets[f]:
            op = deflate_stream(buf, offsets[f], offsets[f + 1], out, op, work, hist, hist4, dyn, stat)
        ends[f] = op
    return out[:op], ends


@njit
def deflate_bytes(data):
    """``deflate_compress(data)`` of one uint8 array (an empty one too: one empty block)."""
    out = np.empty(stream_bound(data.shape[0]), np.uint8)
    dyn = _dynamic_scratch()
    op = deflate_stream(data, 0, data.shape[0], out, 0, new_work(), np.zeros(256, np.int64),
                        np.zeros((4, 256), np.int64), dyn, static_codes())
    return out[:op]


def deflate(data) -> bytes:
    """``deflate_compress(data)`` (Huffman only) of one byte string, compiled."""
    return deflate_bytes(np.frombuffer(bytes(data), np.uint8)).tobytes()
