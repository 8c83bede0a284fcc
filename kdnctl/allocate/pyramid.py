"""PyramidKV-style layer budgets (Cai et al., 2024, arXiv 2406.02069) for any press.

The paper observes that attention is spread widely in lower layers and concentrates on a few
tokens in higher ones ("pyramidal information funneling"), so lower layers get larger
caches. Quotas decrease linearly with depth: with the uniform per-layer quota a, the top
layer gets a/beta and the bottom layer 2a - a/beta (the paper's arithmetic sequence, beta=20
by default), so the total over layers equals the uniform total L*a. Each layer is then
clipped to [sinks + 1, T] while keeping that total (a shift found by bisection), and
rounded with largest remainders (ties to lower layers), which keeps quotas non-increasing.

Scoring and selection are the press's; only the quotas change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from kdnctl.allocate.base import Allocator
from kdnctl.errors import UsageError
from kdnctl.presses.base import ScoreContext


@dataclass
class PyramidAllocator(Allocator):
    name: ClassVar[str] = "pyramid"

    beta: float = 20.0

    def __post_init__(self) -> None:
        if not float(self.beta) >= 1.0:
            raise UsageError(f"pyramid: beta must be >= 1 (1 = uniform), got {self.beta!r}")

    def split(self, ctx: ScoreContext, uniform: list[int], min_tokens: int) -> list[int]:
        return pyramid_split(uniform, ctx.n_tokens, min_tokens, float(self.beta))


def pyramid_split(uniform: list[int], n_tokens: int, min_tokens: int, beta: float) -> list[int]:
    """The pyramid over ``uniform``'s total, each layer in [min_tokens + 1, T]; ``uniform`` when
    there is nothing to shape (one layer, no tokens) or the bounds make it infeasible."""
    n_layers = len(uniform)
    if n_layers <= 1 or n_tokens <= 0:
        return list(uniform)
    lo = min(min_tokens + 1, n_tokens)
    return pyramid_quotas(sum(uniform), n_layers, lo, n_tokens, beta) or list(uniform)


def pyramid_quotas(total: int, n_layers: int, lo: int, hi: int, beta: float) -> list[int] | None:
    """Integer quotas, non-increasing with depth, each in [lo, hi], summing to ``total``;
    None when the bounds make that impossible (the caller then stays uniform)."""
    if not n_layers * lo <= total <= n_layers * hi:
        return None
    avg = total / n_layers
    top = avg / beta
    bottom = 2 * avg - top
    step = (bottom - top) / (n_layers - 1)
    target = [bottom - step * i for i in range(n_layers)]

    def clipped(shift: float) -> list[float]:
        return [min(max(x + shift, lo), hi) for x in target]

    # sum(clipped(c)) is continuous and non-decreasing in c: bisect for the exact total
    a, b = lo - max(target), hi - min(target)
    for _ in range(200):
        c = (a + b) / 2
        if sum(clipped(c)) < total:
            a = c
        else:
            b = c
    xs = clipped((a + b) / 2)
    quotas = [min(max(int(math.floor(x + 1e-9)), lo), hi) for x in xs]
    # largest remainder; ties go to the lower layer so quotas stay non-increasing
    by_frac = sorted(range(n_layers), key=lambda i: (-(xs[i] - math.floor(xs[i] + 1e-9)), i))
    short = total - sum(quotas)
    for i in by_frac:
        if short <= 0:
            break
        if quotas[i] < hi:
            quotas[i] += 1
            short -= 1
    for i in reversed(by_frac):  # float slack the other way: take from the deepest layers
        if short >= 0:
            break
        if quotas[i] > lo:
            quotas[i] -= 1
            short += 1
    return quotas
