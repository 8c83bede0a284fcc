"""StreamingLLM (Xiao et al., 2023, arXiv 2309.17453): keep the attention sinks (the first
``sink_tokens`` tokens) and the most recent tokens, nothing in between.

Implemented as "score = position": after the forced sinks, the top of the rest are the
latest tokens, so the quota decides the window length. ``recent_tokens`` is redundant here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kdnctl.presses.base import Press, ScoreContext


@dataclass
class StreamingPress(Press):
    name: ClassVar[str] = "streaming"

    def score(self, ctx: ScoreContext) -> Tensor:
        pos = torch.arange(ctx.n_tokens, dtype=torch.float32)
        return pos.expand(ctx.n_layers, ctx.n_heads, ctx.n_tokens)
