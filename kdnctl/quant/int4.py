"""int4: asymmetric 4-bit codes packed two per byte along the grouped axis (low nibble = even
index), KIVI layout (keys per channel, values per token). Error <= scale/2 per element.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import GroupwiseQuantizer


@dataclass
class Int4Quantizer(GroupwiseQuantizer):
    name = "int4"
    fmt = "int4"
    bits = 4
