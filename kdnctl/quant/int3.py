"""int3: asymmetric 3-bit codes stored as two bit planes (low two bits packed four per byte,
then the high bit eight per byte), KIVI layout. Exactly 3 bits per code; groups divisible by 8.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import GroupwiseQuantizer


@dataclass
class Int3Quantizer(GroupwiseQuantizer):
    name = "int3"
    fmt = "int3"
    bits = 3
