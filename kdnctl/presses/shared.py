"""One token set for every KV head and every layer, around any press.

Engines whose cache is a list of cells, each holding one token's K/V for every head of every
layer (llama.cpp), cannot hold a selection that differs per head or per layer. ``shared``
takes the wrapped press's scores ``[L, H, T]``, puts every (layer, head) row on the same
scale by ranks (0 = worst, 1 = best), averages them over layers and heads, and keeps the top
of that one ranking plus the wrapped press's forced tokens (sinks, recent), identically in
every layer and head. Quotas are the wrapped press's uniform ones.

It always keeps the document's last token (first of the forced set; in a multi-chunk
document the last chunk's last token). llama.cpp accepts a batch after a cached sequence only
when the batch starts at the sequence's largest cached position + 1 (``llama_batch_allocr``'s
"Y = X + 1" check, ``llama-batch.cpp``); with the last token kept, that position is the
document's length and the question continues at its original positions, as it would after a
full prefill.

The cost: every head must keep tokens that only some heads need. It is measured, not assumed:
``python bench/engines.py --quality`` (docs/engines.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from kdnctl.errors import UsageError
from kdnctl.presses.base import Press, ScoreContext, sanitize, select_top
from kdnctl.presses.registry import get_ranking_press
from kdnctl.scorers.rank import rank01


@dataclass
class SharedPress(Press):
    name: ClassVar[str] = "shared"
    # the default wrapped press (kvcrush) ranks by the scorer; a class-level answer, as the
    # recipe asks the class
    uses_importance: ClassVar[bool] = True

    press: str = "kvcrush"  # the wrapped press (registry name) whose scores are shared
    press_options: dict = field(default_factory=dict)
    # "rank": each (layer, head) row's ranks, averaged (rows on different scales count alike);
    # "mean": the scores themselves, averaged (a score already on one scale, such as a sentence's)
    by: str = "rank"
    keep_last: bool = True  # the document's last token among the forced ones (llama.cpp's batch rule)

    def __post_init__(self) -> None:
        super().__post_init__()
        if str(self.press).strip().lower() == self.name:
            raise UsageError("shared cannot wrap itself")
        if self.by not in ("rank", "mean"):
            raise UsageError(f"shared: by must be rank or mean, got {self.by!r}", param="by")
        opts = {"sink_tokens": self.sink_tokens, "recent_tokens": self.recent_tokens, **self.press_options}
        self.inner = get_ranking_press(str(self.press), **opts)

    def score(self, ctx: ScoreContext) -> Tensor:
        return self.inner.score(ctx)

    def token_scores(self, ctx: ScoreContext) -> Tensor:
        """``[T]``: the mean over layers and heads of each row's rank of the wrapped scores (``by``
        "mean": of the scores)."""
        scores = sanitize(self.inner.score(ctx))
        return (rank01(scores, stable=True) if self.by == "rank" else scores).mean(dim=(0, 1))

    def forced_indices(self, n_tokens: int, k: int, *, keep_sinks: bool = True,
                       keep_recent: bool = True) -> Tensor:
        """The last token (when ``keep_recent``: the document's tail), then the wrapped press's
        forced tokens; at most k."""
        inner = self.inner.forced_indices(n_tokens, k, keep_sinks=keep_sinks, keep_recent=keep_recent)
        if not keep_recent or not self.keep_last or n_tokens == 0 or k == 0:
            return inner
        last = torch.tensor([n_tokens - 1], dtype=torch.long)
        return torch.cat([last, inner[inner != n_tokens - 1]])[:k]

    def select(self, ctx: ScoreContext, quotas: list[int], *, keep_sinks: bool = True,
               keep_recent: bool = True) -> list[Tensor]:
        ks = self.check_quotas(ctx, quotas)
        if len(set(ks)) > 1:
            raise ValueError(f"shared needs one quota for every layer, got {sorted(set(ks))}")
        if not ks:
            return []
        k, t, h = ks[0], ctx.n_tokens, ctx.n_heads
        forced = self.forced_indices(t, k, keep_sinks=keep_sinks, keep_recent=keep_recent)
        idx = select_top(self.token_scores(ctx).unsqueeze(0), k, forced)  # [1, k]
        return [idx.expand(h, k).contiguous() for _ in ks]
