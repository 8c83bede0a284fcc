"""Uniform per-layer quotas: every layer keeps the same number of tokens (the default)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kdnctl.allocate.base import Allocator
from kdnctl.presses.base import ScoreContext


@dataclass
class UniformAllocator(Allocator):
    name: ClassVar[str] = "uniform"

    def split(self, ctx: ScoreContext, uniform: list[int], min_tokens: int) -> list[int]:
        return list(uniform)
