"""fp8: float8 e4m3fn codes (stored as their uint8 bit pattern) with a per-group scale and a
mid-range zero point, KIVI layout. Same size as int8; relative rather than uniform precision,
so it is worse than int8 on smooth groups and kinder to a lone large value inside a group.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import GroupwiseQuantizer


@dataclass
class Fp8Quantizer(GroupwiseQuantizer):
    name = "fp8"
    fmt = "fp8"
    bits = 8
