"""Adaptive per-layer budgets: give each layer the share of the document's quota that its own
attention says it needs, then let any press pick the tokens within each layer's share.

PyramidKV fixes the shape of the allocation in advance (more tokens in lower layers). Offline
we can measure it instead: ingest records, per layer and KV head, the attention every token
received from all later queries (``stats.accum``). Normalised per head, that is how the layer
spreads its attention mass. A layer whose mass sits on a few tokens loses little when the rest
go; a layer that spreads it needs more. Allocation is a greedy water-filling over layers:
every layer first gets ``floor`` times the uniform quota (never starve a layer), then the rest
of the document's total goes, one token at a time, to the layer whose next-best token holds the
most attention mass (mean over heads of each head's sorted, normalised mass). The total over
layers equals the uniform total exactly; the question is never used. Any press then picks the
tokens within each layer's share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kdnctl.allocate.base import Allocator
from kdnctl.errors import UsageError
from kdnctl.presses.base import ScoreContext, round_half_up, sanitize


@dataclass
class AdaptiveAllocator(Allocator):
    name: ClassVar[str] = "adaptive"
    needs_stats: ClassVar[tuple[str, ...]] = ("accum",)

    floor: float = 0.25

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.floor) <= 1.0:
            raise UsageError(f"adaptive: floor must be in [0, 1], got {self.floor!r}")

    def split(self, ctx: ScoreContext, uniform: list[int], min_tokens: int) -> list[int]:
        return adaptive_quotas(ctx.stat("accum", self.name), uniform, float(self.floor), min_tokens)


def adaptive_quotas(accum: Tensor, uniform: list[int], floor: float, min_tokens: int = 0) -> list[int]:
    """Per-layer quotas summing to ``sum(uniform)`` from ``[L, H, T]`` attention mass."""
    l, h, t = accum.shape
    total = sum(uniform)
    mass = sanitize(accum).clamp_min(0)
    mass = mass / mass.sum(dim=-1, keepdim=True).clamp_min(1e-12)
    gains = mass.sort(dim=-1, descending=True).values.mean(dim=1)  # [L, T], non-increasing per layer
    base = min(max(round_half_up(floor * total / max(l, 1)), min_tokens), t)
    if base * l >= total:
        return uniform
    # token-major order + stable sort: equal gains go round-robin over layers (deterministic)
    rest = gains[:, base:].T.flatten()
    top = torch.sort(rest, descending=True, stable=True).indices[: total - base * l]
    extra = torch.bincount(top % l, minlength=l)
    return [base + int(e) for e in extra]
