"""A frame coder: the lossless stage under ``ec``'s codes and params (one per file, found by
name in ``kdnctl.quant.coders.CODERS``; a bundle names its coder in ``meta["quant"]["coding"]``)."""

from __future__ import annotations

from typing import ClassVar


class FrameCoder:
    """Compresses one frame's bytes and decodes them back, to exactly ``size`` bytes or a
    ``BundleFormatError`` naming ``what``."""

    name: ClassVar[str] = "base"

    def compress(self, data: bytes, codes: bool = True) -> bytes:
        """``codes``: the frame holds packed codes (not parameters), which some coders treat apart."""
        raise NotImplementedError

    def decompress(self, blob, size: int, what: str) -> bytes:
        raise NotImplementedError
