"""Frame coders of ``ec`` bundles, one per file, found by name in ``CODERS``.

Adding one: a ``FrameCoder`` subclass in its own file and one entry below; a bundle written with
it names it in ``meta["quant"]["coding"]``, and every kdnctl that has it reads it."""

from __future__ import annotations

from .base import FrameCoder
from .deflate import DeflateCoder
from .zstd import ZstdCoder

CODERS: dict[str, FrameCoder] = {c.name: c for c in (DeflateCoder(), ZstdCoder())}

__all__ = ["CODERS", "FrameCoder"]
