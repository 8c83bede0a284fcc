"""One token set for every KV head and every layer, around any press.

Engines whose cache is a list of cells, each holding one token's K/V for every head of every
layer (llama.cpp), cannot hold a selection that differs per head or per layer. ``shared``
takes the wrapped press's scores ``[L, H, T]``, puts every (layer, head) row on the same
scale by ranks (0 = worst, 1 = best), averages them over layers and heads, and keeps the top
of that one ranking plus the wrapped press's forced tokens (sinks, recent), identically in
every layer and head. Quotas are the wrapped press's uniform ones.

The cost: every head must keep tokens that only some heads need. It is measured, not assumed:
``python bench/engines.py --quality`` (docs/engines.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from kdnctl.presses.base import ScoreContext, sanitize, select_top
from kdnctl.presses.spans import rank01
from kdnctl.presses.wrapper import LayerBudgetWrapper


@dataclass
class SharedPress(LayerBudgetWrapper):
    name: ClassVar[str] = "shared"

    press: Any = "kvcrush"

    def quotas_for_budget(self, budget: float, n_tokens: int, n_layers: int) -> list[int]:
        return self.inner.quotas_for_budget(budget, n_tokens, n_layers)

    def quotas_for(self, ctx: ScoreContext, budget: float) -> list[int]:
        return self.inner.quotas_for_budget(budget, ctx.n_tokens, ctx.n_layers)

    def token_scores(self, ctx: ScoreContext) -> Tensor:
        """``[T]``: the mean over layers and heads of each row's rank of the wrapped scores."""
        return rank01(sanitize(self.inner.score(ctx))).mean(dim=(0, 1))

    def select(self, ctx: ScoreContext, quotas: list[int], *, keep_sinks: bool = True,
               keep_recent: bool = True) -> list[Tensor]:
        ks = self.check_quotas(ctx, quotas)
        if len(set(ks)) > 1:
            raise ValueError(f"shared needs one quota for every layer, got {sorted(set(ks))}")
        if not ks:
            return []
        k, t, h = ks[0], ctx.n_tokens, ctx.n_heads
        forced = self.inner.forced_indices(t, k, keep_sinks=keep_sinks, keep_recent=keep_recent)
        idx = select_top(self.token_scores(ctx).unsqueeze(0), k, forced)  # [1, k]
        return [idx.expand(h, k).contiguous() for _ in ks]
