"""Reading LMDB's on-disk structures without mapping the file (the checks in catalog.py).

LMDB maps data.mdb and trusts it, so a page it reads past the end of the file is a SIGBUS.
Everything here reads with plain file reads, where a short read is an error, not a signal.

Layout (lmdb.h / mdb.c, 64-bit): every page starts with a 16-byte header (pgno u64, pad u16,
flags u16, lower u16, upper u16; an overflow page keeps its page count where lower/upper are).
Pages 0 and 1 are meta pages: magic, version, map address, map size, two database records (the
free-page DB, then the main DB; 48 bytes each: pad u32 holding the page size in the free DB's
record, flags u16, depth u16, four counters u64, root u64), last page number, txn id. Branch and
leaf pages hold u16 offsets to nodes (lo u16, hi u16, flags u16, key size u16, key, data); a
branch node's child page is lo | hi << 16 | flags << 32, a leaf node's data size is lo | hi << 16
and, with F_BIGDATA, its data is the number of the first overflow page holding it.
"""

from __future__ import annotations

import struct
from typing import BinaryIO

LMDB_MAGIC = 0xBEEFC0DE
LMDB_DATA_VERSION = 1
PAGE_HEADER = 16
P_BRANCH, P_LEAF, P_OVERFLOW, P_META = 0x01, 0x02, 0x04, 0x08
F_BIGDATA = 0x01
NODE_HEADER = 8
P_INVALID = (1 << 64) - 1
_DB_RECORD = 48
_META_DBS = PAGE_HEADER + 24
META_LAST_PG = _META_DBS + 2 * _DB_RECORD
_MAX_DEPTH = 32  # LMDB's own cursor stack depth; deeper means a cycle or garbage


class LmdbFileError(Exception):
    """The file does not hold what LMDB would need (message says what)."""


def read_meta(data: bytes) -> dict | None:
    """Fields of the meta page at the start of ``data``, or None if it is not one."""
    if len(data) < META_LAST_PG + 16:
        return None
    _pgno, _pad, flags = struct.unpack_from("<QHH", data, 0)
    magic, version = struct.unpack_from("<II", data, PAGE_HEADER)
    psize = struct.unpack_from("<I", data, _META_DBS)[0]  # the free DB record's pad
    free_root = struct.unpack_from("<Q", data, _META_DBS + 40)[0]
    last_pg, txnid = struct.unpack_from("<QQ", data, META_LAST_PG)
    if not flags & P_META or magic != LMDB_MAGIC or version != LMDB_DATA_VERSION:
        return None
    if psize < 512 or psize > 65536 or psize & (psize - 1):
        return None
    return {"psize": psize, "last_pg": last_pg, "txnid": txnid, "free_root": free_root}


def read_page(f: BinaryIO, psize: int, pgno: int, n_pages: int = 1) -> bytes:
    f.seek(pgno * psize)
    data = f.read(psize * n_pages)
    if len(data) != psize * n_pages:
        raise LmdbFileError(f"page {pgno} lies past the end of the file")
    if struct.unpack_from("<Q", data, 0)[0] != pgno:
        raise LmdbFileError(f"page {pgno} does not carry its own number")
    return data


def _nodes(page: bytes, psize: int):
    """(lo, hi, flags, key, offset of the data) of each node of a branch or leaf page."""
    lower = struct.unpack_from("<H", page, 12)[0]
    if lower < PAGE_HEADER or lower > psize:
        raise LmdbFileError("a page's node table is out of bounds")
    for i in range((lower - PAGE_HEADER) // 2):
        off = struct.unpack_from("<H", page, PAGE_HEADER + 2 * i)[0]
        if off < lower or off + NODE_HEADER > psize:
            raise LmdbFileError("a node lies outside its page")
        lo, hi, flags, ksize = struct.unpack_from("<HHHH", page, off)
        start = off + NODE_HEADER
        if start + ksize > psize:
            raise LmdbFileError("a node's key lies outside its page")
        yield lo, hi, flags, page[start:start + ksize], start + ksize


def free_pages(f: BinaryIO, psize: int, free_root: int, last_pg: int) -> set[int]:
    """Page numbers listed in the free-page DB rooted at ``free_root`` (every value is an ID
    list: a u64 count, then that many page numbers). Pages of the DB itself must be readable."""
    out: set[int] = set()
    if free_root == P_INVALID:
        return out
    stack, seen = [(free_root, 0)], set()
    while stack:
        pgno, depth = stack.pop()
        if pgno > last_pg or pgno in seen or depth > _MAX_DEPTH:
            raise LmdbFileError(f"the free-page tree points at page {pgno} out of order")
        seen.add(pgno)
        page = read_page(f, psize, pgno)
        flags = struct.unpack_from("<H", page, 10)[0]
        for lo, hi, nflags, _key, dpos in _nodes(page, psize):
            if flags & P_BRANCH:
                stack.append((lo | hi << 16 | nflags << 32, depth + 1))
                continue
            if not flags & P_LEAF:
                raise LmdbFileError(f"page {pgno} of the free-page tree is neither branch nor leaf")
            size = lo | hi << 16
            if nflags & F_BIGDATA:
                (ov,) = struct.unpack_from("<Q", page, dpos)
                if ov > last_pg:
                    raise LmdbFileError(f"a free-page list points at page {ov} past the last page")
                head = read_page(f, psize, ov)
                if not struct.unpack_from("<H", head, 10)[0] & P_OVERFLOW:
                    raise LmdbFileError(f"page {ov} holds a free-page list but is not an overflow page")
                n_pages = struct.unpack_from("<I", head, 12)[0]
                data = read_page(f, psize, ov, n_pages)[PAGE_HEADER:PAGE_HEADER + size]
            else:
                data = page[dpos:dpos + size]
            if len(data) < size or size % 8:
                raise LmdbFileError("a free-page list is cut short")
            ids = struct.unpack_from(f"<{size // 8}Q", data)
            if not ids or ids[0] > len(ids) - 1:
                raise LmdbFileError("a free-page list counts more pages than it holds")
            out.update(ids[1:1 + ids[0]])
    return out
