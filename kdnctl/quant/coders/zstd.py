"""zstd frames: how ``ec`` bundles before format 1.6 were written (read; written only by
``research/probes/ec_coders.py``, which compares coders)."""

from __future__ import annotations

from ...errors import BundleFormatError, InputError
from .base import FrameCoder

ZSTD_LEVEL = 3


def _zstd():
    try:
        import zstandard
    except ImportError as exc:  # a core dependency; a broken install should say so plainly
        raise InputError("the 'zstandard' package is missing", hint="pip install zstandard") from exc
    return zstandard


class ZstdCoder(FrameCoder):
    name = "zstd"

    def compress(self, data: bytes, codes: bool = True) -> bytes:
        return _zstd().ZstdCompressor(level=ZSTD_LEVEL).compress(data)

    def decompress(self, blob, size: int, what: str) -> bytes:
        z = _zstd()
        try:
            out = z.ZstdDecompressor().decompress(blob, max_output_size=size)
        except z.ZstdError:
            raise BundleFormatError(f"{what} is not a valid zstd frame") from None
        if len(out) != size:
            raise BundleFormatError(f"{what} decodes to {len(out)} bytes, expected {size}")
        return out
