"""int2: asymmetric 2-bit codes packed four per byte along the grouped axis, KIVI layout
(keys per channel, values per token). Groups divisible by 8; error <= scale/2 per element.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import GroupwiseQuantizer


@dataclass
class Int2Quantizer(GroupwiseQuantizer):
    name = "int2"
    fmt = "int2"
    bits = 2
