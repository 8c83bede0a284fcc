"""int8: asymmetric 8-bit codes, KIVI layout (keys per channel, values per token).

~1.06 B/element at group 64 with float16 scale/zero; error <= scale/2 per element.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import GroupwiseQuantizer


@dataclass
class Int8Quantizer(GroupwiseQuantizer):
    name = "int8"
    fmt = "int8"
    bits = 8
