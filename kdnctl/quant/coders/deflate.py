"""Raw deflate, Huffman coding only for codes (format 1.6 on; what ``ec`` writes).

No zlib header or checksum: the store hashes every object. A matcher finds nothing in packed codes
but spends bits on spurious matches, so codes are Huffman-coded only; params keep the default
strategy. Any inflate decodes the frames; ISA-L's runs ~1.9x as fast as zlib's on them
(``bench/ec_decode.py`` measures both in one run)."""

from __future__ import annotations

import functools
import zlib

from ...errors import BundleFormatError, InputError
from .base import FrameCoder

DEFLATE_LEVEL = 6  # zlib's default; with Huffman coding only nothing is matched, so it hardly matters
# Which inflate decodes the frames: "isal" (ISA-L, python-isal) where installed, else "zlib".
INFLATER = "isal"


def deflate_compress(data: bytes, huffman_only: bool = True) -> bytes:
    z = zlib.compressobj(DEFLATE_LEVEL, zlib.DEFLATED, -15, 9,
                         zlib.Z_HUFFMAN_ONLY if huffman_only else zlib.Z_DEFAULT_STRATEGY)
    return z.compress(data) + z.flush()


@functools.lru_cache(maxsize=4)
def inflate_module(name: str):
    """The zlib-compatible module (``decompressobj``, ``error``) that inflates for ``name``."""
    if name == "isal":
        try:
            from isal import isal_zlib
        except ImportError:  # optional: the frames decode the same with zlib, only slower
            return zlib
        return isal_zlib
    if name == "zlib":
        return zlib
    raise InputError(f"unknown inflater {name!r}", hint="isal or zlib")


def deflate_decompress(blob, size: int, what: str) -> bytes:
    mod = inflate_module(INFLATER)
    z = mod.decompressobj(-15)
    try:
        out = z.decompress(blob, size)
    except (zlib.error, mod.error):
        raise BundleFormatError(f"{what} is not a valid deflate stream") from None
    if len(out) != size or not z.eof or z.unconsumed_tail or z.unused_data:
        raise BundleFormatError(f"{what} does not decode to exactly {size} bytes")
    return out


class DeflateCoder(FrameCoder):
    name = "deflate"

    def compress(self, data: bytes, codes: bool = True) -> bytes:
        return deflate_compress(data, huffman_only=codes)

    def decompress(self, blob, size: int, what: str) -> bytes:
        return deflate_decompress(blob, size, what)
