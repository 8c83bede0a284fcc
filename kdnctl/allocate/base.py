"""How a document's token budget is split over layers: the ``Allocator`` interface.

A press decides WHICH tokens a layer keeps; an allocator decides HOW MANY each layer keeps.
``allocate`` starts from the press's uniform quota (``round(budget * T)`` per layer, at least
its sink tokens) and lets the allocator move tokens between layers; every allocator keeps the
total over layers equal to the uniform total, so one budget means the same bytes whatever the
allocator. Allocators are chosen by name (``allocator = "pyramid"`` in a recipe, ``--allocator``
on the command line) from the registry in :mod:`kdnctl.allocate`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kdnctl.presses.base import Press, ScoreContext


@dataclass
class Allocator:
    """Base of every allocator: subclasses implement :meth:`split`."""

    name: ClassVar[str] = "base"
    # Ingest statistics the allocator reads from the score context (for error messages and docs).
    needs_stats: ClassVar[tuple[str, ...]] = ()

    def split(self, ctx: ScoreContext, uniform: list[int], min_tokens: int) -> list[int]:
        """Per-layer quotas summing to ``sum(uniform)``, each at most ``ctx.n_tokens``;
        ``min_tokens`` is the press's forced prefix (sinks), which a layer should not go under."""
        raise NotImplementedError


def allocate(allocator: Allocator, press: Press, ctx: ScoreContext, budget: float) -> list[int]:
    """Per-layer quotas of ``press`` at ``budget`` over ``ctx``, split by ``allocator``."""
    uniform = press.quotas_for_budget(budget, ctx.n_tokens, ctx.n_layers)
    return allocator.split(ctx, uniform, press.sink_tokens)
