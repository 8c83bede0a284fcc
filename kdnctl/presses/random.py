"""Random press: a seeded baseline that keeps uniformly random tokens (plus forced sinks and
recent tokens). It tells whether a scoring press beats chance at the same budget.

The random value of a token depends only on (seed, absolute position, layer, head): values
are drawn token-major for positions ``0 .. offset+T`` so a chunk context (``offset`` > 0)
sees exactly the numbers the whole document would, whatever the chunking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kdnctl.presses.base import Press, ScoreContext


@dataclass
class RandomPress(Press):
    name: ClassVar[str] = "random"

    seed: int | None = None  # None: use the context's seed

    def score(self, ctx: ScoreContext) -> Tensor:
        seed = ctx.seed if self.seed is None else int(self.seed)
        gen = torch.Generator().manual_seed(seed)
        n = ctx.offset + ctx.n_tokens
        draws = torch.rand(n, ctx.n_layers, ctx.n_heads, generator=gen)
        return draws[ctx.offset :].permute(1, 2, 0).contiguous()
