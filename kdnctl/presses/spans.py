"""Spans: keep whole runs of consecutive tokens, the same ones in every layer and KV head.

Token-level presses keep a different scatter of tokens in every head; on a small model that
leaves no head with a readable copy of any sentence. Offline we do not know the question, so
this press instead extracts the passages the model itself finds important: the scorer's
``[L, H, T]`` importance is rank-normalised per (layer, head), averaged into one score per
token, averaged again over spans of ``span_tokens`` consecutive tokens, and the top spans are
kept whole, identically in every layer and head (an extractive summary in KV form).

Because every head gets the same score, the base class's top-k (stable, earlier position
first on ties) takes spans whole in score order and fills the quota exactly from the first
span that does not fit; sinks (e.g. the prompt header) and recent tokens are forced as usual.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kdnctl.errors import UsageError
from kdnctl.presses.base import Press, ScoreContext, sanitize
from kdnctl.scorers.rank import rank01


@dataclass
class SpansPress(Press):
    name: ClassVar[str] = "spans"
    uses_importance: ClassVar[bool] = True

    span_tokens: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.span_tokens, bool) or not isinstance(self.span_tokens, int) or self.span_tokens < 1:
            raise UsageError(f"spans: span_tokens must be a positive integer, got {self.span_tokens!r}")

    def score(self, ctx: ScoreContext) -> Tensor:
        l, h, t = ctx.importance.shape
        token = rank01(sanitize(ctx.importance), stable=True).mean(dim=(0, 1))  # [T]
        # spans are aligned to absolute document positions, so chunk contexts agree with the document's
        span_of = (torch.arange(t) + ctx.offset) // self.span_tokens
        span_of = span_of - span_of[0]
        n = int(span_of[-1]) + 1 if t else 0
        sums = torch.zeros(n).index_add_(0, span_of, token)
        means = sums / torch.bincount(span_of, minlength=n).clamp_min(1)
        return means[span_of].expand(l, h, t).contiguous()
