"""A compiled inflate written for the deflate streams kdnctl's encoder writes: a probe of whether
one made for these frames beats ISA-L's (``literal_inflate_ab.py``). It does not: ISA-L stays.

ec frames are raw deflate coded with Huffman codes only (zlib's ``Z_HUFFMAN_ONLY``): literals and
an end of block, never a match, a few thousand bytes each, from an alphabet of a few dozen
codes. This decoder builds a table of ``2**LOOKUP_BITS`` entries per block, each decoding up to
four literals at once, and reads the code lengths bit by bit.

It is a fast path, not a judge: :func:`inflate_literals` returns True only for a stream it
decodes completely and exactly as the format defines (every block's codes complete, only
literals, the last block final, the output exactly ``n_out`` bytes, the input exactly ``n_in``
bytes). Anything else (a match, an incomplete or over-subscribed code, a truncated stream,
bytes left over, too much or too little output) returns False without a verdict, for a general
inflater to decide.
"""

from __future__ import annotations

import functools

import numba
import numpy as np

njit = functools.partial(numba.njit, nogil=True, cache=True)

LOOKUP_BITS = 10  # the multi-literal table's index bits
MAX_BITS = 15  # deflate's longest code
_MASK = (1 << LOOKUP_BITS) - 1
# the order in which a dynamic block sends its code-length code's lengths (RFC 1951, 3.2.7)
CL_ORDER = np.array([16, 17, 18, 0, 8, 7, 9, 6, 10, 5, 11, 4, 12, 3, 13, 2, 14, 1, 15], np.int64)
WORK_INTS = 2 * 320 + 2 * 16 + 320 + 2 * 19 + 64  # ``work``: the code lengths, counts and sorted symbols
TABLE_INTS = (1 << LOOKUP_BITS) * 2


def new_tables() -> tuple[np.ndarray, np.ndarray]:
    """Scratch for :func:`inflate_literals`: ``(table, work)``; one pair per thread."""
    return np.zeros(TABLE_INTS, np.int64), np.zeros(WORK_INTS, np.int64)


@njit
def _canonical(lens, n, cnt, syms) -> int:
    """Counts per length (``cnt[1..15]``) and the symbols sorted by (length, symbol) (``syms``)
    of the code whose lengths are ``lens[:n]``. Returns 0 complete, 1 incomplete (or empty), -1
    over-subscribed."""
    for i in range(MAX_BITS + 1):
        cnt[i] = 0
    for s in range(n):
        cnt[lens[s]] += 1
    left = 1
    for ln in range(1, MAX_BITS + 1):
        left = (left << 1) - cnt[ln]
        if left < 0:
            return -1
    offs = np.empty(MAX_BITS + 1, np.int64)
    offs[1] = 0
    for ln in range(1, MAX_BITS):
        offs[ln + 1] = offs[ln] + cnt[ln]
    for s in range(n):
        if lens[s] != 0:
            syms[offs[lens[s]]] = s
            offs[lens[s]] += 1
    return 0 if left == 0 else 1


@njit
def _slow_symbol(bitbuf, cnt, syms):
    """``(symbol, bits)`` of the canonical code at the front of ``bitbuf`` (bit by bit, the code's
    first bit first), or ``(-1, 0)``. For codes longer than the table and the code-length code."""
    code, first, index = 0, 0, 0
    for ln in range(1, MAX_BITS + 1):
        code |= np.int64((bitbuf >> np.uint64(ln - 1)) & np.uint64(1))
        count = cnt[ln]
        if code - count < first:
            return syms[index + (code - first)], ln
        index += count
        first += count
        first <<= 1
        code <<= 1
    return -1, 0


@njit
def _build_table(lens, n, cnt, syms, single, multi):
    """The literal/length code's tables: ``single[i]`` = symbol | bits << 16 of the code that
    the next ``LOOKUP_BITS`` bits ``i`` start with (0 bits: a longer code, decoded slowly);
    ``multi[i]`` = up to four literals (a byte each) | their count << 32 | their bits << 40."""
    nxt = np.zeros(MAX_BITS + 2, np.int64)
    code = 0
    for ln in range(1, MAX_BITS + 1):
        code = (code + cnt[ln - 1]) << 1 if ln > 1 else 0
        nxt[ln] = code
    for i in range(1 << LOOKUP_BITS):
        single[i] = 0
    for s in range(n):
        ln = lens[s]
        if ln == 0:
            continue
        c = nxt[ln]
        nxt[ln] += 1
        rev = 0
        for k in range(ln):  # deflate sends a code's first bit first: the table reads it reversed
            rev |= ((c >> k) & 1) << (ln - 1 - k)
        if ln <= LOOKUP_BITS:
            for i in range(rev, 1 << LOOKUP_BITS, 1 << ln):
                single[i] = s | (ln << 16)
    for i in range(1 << LOOKUP_BITS):
        packed, k, used = 0, 0, 0
        while k < 4:
            e = single[(i >> used) & _MASK]
            ln = e >> 16
            s = e & 0xFFFF
            if ln == 0 or ln > LOOKUP_BITS - used or s >= 256:
                break
            packed |= s << (8 * k)
            k += 1
            used += ln
        multi[i] = packed | (k << 32) | (used << 40)


@njit
def inflate_literals(src, s0, n_in, dst, d0, n_out, table, work) -> bool:
    """``src[s0:s0 + n_in]`` (uint8) inflated to exactly ``dst[d0:d0 + n_out]`` (uint8) where the
    stream is Huffman-coded literals only (see the module); False leaves the verdict to a general
    inflater (``dst`` may hold garbage there). ``table``, ``work``: :func:`new_tables`."""
    single, multi = table[: 1 << LOOKUP_BITS], table[1 << LOOKUP_BITS:]
    lens = work[:320]
    cnt = work[320:336]
    syms = work[336:656]
    cl_cnt = work[656:672]
    cl_syms = work[672:691]
    cl_lens = work[691:710]
    end_in, end_out = s0 + n_in, d0 + n_out
    pos, o = s0, d0
    bitbuf, bitcnt = np.uint64(0), 0
    final = False
    while not final:
        # refill to at least 57 bits (zeros past the end: the end check below catches their use)
        while bitcnt <= 56:
            if pos < end_in:
                bitbuf |= np.uint64(src[pos]) << np.uint64(bitcnt)
            pos += 1
            bitcnt += 8
        final = (bitbuf & np.uint64(1)) == np.uint64(1)
        btype = np.int64((bitbuf >> np.uint64(1)) & np.uint64(3))
        bitbuf >>= np.uint64(3)
        bitcnt -= 3
        if btype == 0:  # stored: LEN, NLEN at the next byte boundary, then LEN bytes
            drop = bitcnt & 7
            bitcnt -= drop
            pos -= bitcnt >> 3  # the whole bytes still in the buffer are read again from src
            bitbuf, bitcnt = np.uint64(0), 0
            if pos + 4 > end_in:
                return False
            ln = np.int64(src[pos]) | (np.int64(src[pos + 1]) << 8)
            nln = np.int64(src[pos + 2]) | (np.int64(src[pos + 3]) << 8)
            pos += 4
            if ln != (~nln & 0xFFFF) or pos + ln > end_in or o + ln > end_out:
                return False
            for i in range(ln):
                dst[o + i] = src[pos + i]
            pos += ln
            o += ln
            continue
        if btype == 1:  # fixed codes
            for s in range(288):
                lens[s] = 8 if s < 144 else 9 if s < 256 else 7 if s < 280 else 8
            n_lit = 288
        elif btype == 2:
            n_lit = 257 + np.int64(bitbuf & np.uint64(31))
            n_dist = 1 + np.int64((bitbuf >> np.uint64(5)) & np.uint64(31))
            n_cl = 4 + np.int64((bitbuf >> np.uint64(10)) & np.uint64(15))
            bitbuf >>= np.uint64(14)
            bitcnt -= 14
            if n_lit > 286 or n_dist > 30:
                return False
            for i in range(19):
                cl_lens[i] = 0
            for i in range(n_cl):
                if bitcnt < 3:
                    while bitcnt <= 56:
                        if pos < end_in:
                            bitbuf |= np.uint64(src[pos]) << np.uint64(bitcnt)
                        pos += 1
                        bitcnt += 8
                cl_lens[CL_ORDER[i]] = np.int64(bitbuf & np.uint64(7))
                bitbuf >>= np.uint64(3)
                bitcnt -= 3
            if _canonical(cl_lens, 19, cl_cnt, cl_syms) != 0:
                return False
            i = 0
            while i < n_lit + n_dist:
                if bitcnt < 16:
                    while bitcnt <= 56:
                        if pos < end_in:
                            bitbuf |= np.uint64(src[pos]) << np.uint64(bitcnt)
                        pos += 1
                        bitcnt += 8
                s, ln = _slow_symbol(bitbuf, cl_cnt, cl_syms)
                if s < 0:
                    return False
                bitbuf >>= np.uint64(ln)
                bitcnt -= ln
                if s < 16:
                    lens[i] = s
                    i += 1
                    continue
                if s == 16:
                    if i == 0:
                        return False
                    v, rep = lens[i - 1], 3 + np.int64(bitbuf & np.uint64(3))
                    bitbuf >>= np.uint64(2)
                    bitcnt -= 2
                elif s == 17:
                    v, rep = 0, 3 + np.int64(bitbuf & np.uint64(7))
                    bitbuf >>= np.uint64(3)
                    bitcnt -= 3
                else:
                    v, rep = 0, 11 + np.int64(bitbuf & np.uint64(127))
                    bitbuf >>= np.uint64(7)
                    bitcnt -= 7
                if i + rep > n_lit + n_dist:
                    return False
                for k in range(rep):
                    lens[i + k] = v
                i += rep
            if lens[256] == 0:
                return False
            # the distance code is never used, but a general inflater refuses one that is not complete
            if _canonical(lens[n_lit:n_lit + n_dist], n_dist, cnt, syms) != 0:
                return False
        else:
            return False
        if _canonical(lens, n_lit, cnt, syms) != 0:
            return False
        _build_table(lens, n_lit, cnt, syms, single, multi)
        while True:
            if bitcnt < MAX_BITS:
                while bitcnt <= 56:
                    if pos < end_in:
                        bitbuf |= np.uint64(src[pos]) << np.uint64(bitcnt)
                    pos += 1
                    bitcnt += 8
                if pos > end_in + 16:  # decoding zeros past the end: truncated
                    return False
            e = multi[np.int64(bitbuf & np.uint64(_MASK))]
            k = (e >> 32) & 7
            if k > 0:
                if o + 4 <= end_out:  # four stores, whatever k: one 32-bit store once compiled
                    dst[o] = e & 255
                    dst[o + 1] = (e >> 8) & 255
                    dst[o + 2] = (e >> 16) & 255
                    dst[o + 3] = (e >> 24) & 255
                elif o + k > end_out:
                    return False
                else:
                    for j in range(k):
                        dst[o + j] = (e >> (8 * j)) & 255
                o += k
                used = e >> 40
                bitbuf >>= np.uint64(used)
                bitcnt -= used
                continue
            e1 = single[np.int64(bitbuf & np.uint64(_MASK))]
            s, ln = e1 & 0xFFFF, e1 >> 16
            if ln == 0:
                s, ln = _slow_symbol(bitbuf, cnt, syms)
                if s < 0:
                    return False
            bitbuf >>= np.uint64(ln)
            bitcnt -= ln
            if s < 256:
                if o >= end_out:
                    return False
                dst[o] = s
                o += 1
            elif s == 256:
                break
            else:  # a match: not a stream this decodes
                return False
    used_in = pos - (bitcnt >> 3) - s0  # a byte begun counts as read
    return used_in == n_in and o == end_out


@njit
def inflate_frames(src, s_off, s_len, dst, d_off, d_len, table, work, ok):
    """Frame f: ``src[s_off[f]:+s_len[f]]`` by :func:`inflate_literals` into ``d_len[f]`` bytes
    at ``d_off[f]``; ``ok[f]`` False where it leaves the verdict to a general inflater."""
    for f in range(s_off.shape[0]):
        ok[f] = inflate_literals(src, s_off[f], s_len[f], dst, d_off[f], d_len[f], table, work)
