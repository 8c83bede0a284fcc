"""SnapKV (Li et al., 2024, arXiv 2404.14469): keep the tokens the last queries of the prompt
(the "observation window") attend to, after smoothing those scores over neighbouring tokens.

Ingest records the observation-window attention per layer and KV head as
``stats["window"]`` ``[L, H, T]``; this press only pools and ranks it. Pooling keeps the
neighbours of an important token too, which is what the paper found preserves the detail
around a hit (a lone token without its context is rarely useful). The paper also always
keeps the observation window itself: set ``recent_tokens`` to the window length for that.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch.nn.functional as F
from torch import Tensor

from kdnctl.errors import UsageError
from kdnctl.presses.base import Press, ScoreContext, sanitize


@dataclass
class SnapKVPress(Press):
    name: ClassVar[str] = "snapkv"

    kernel_size: int = 7
    pooling: str = "max"  # "max" | "avg"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.kernel_size, int) or self.kernel_size < 1 or self.kernel_size % 2 == 0:
            # an odd window centred on each token keeps the output aligned with the input
            raise UsageError(f"snapkv: kernel_size must be a positive odd integer, got {self.kernel_size!r}")
        if self.pooling not in ("max", "avg"):
            raise UsageError(f"snapkv: pooling must be 'max' or 'avg', got {self.pooling!r}")

    def score(self, ctx: ScoreContext) -> Tensor:
        return pool_scores(ctx.stat("window", self.name), self.kernel_size, self.pooling)


def pool_scores(scores: Tensor, kernel_size: int, pooling: str) -> Tensor:
    """1-D pooling over the token axis of ``[L, H, T]``; same length out, edges not padded
    with fake values (max pads with -inf, avg divides by the real neighbour count)."""
    if kernel_size == 1:
        return sanitize(scores)
    l, h, t = scores.shape
    x = sanitize(scores).reshape(l * h, 1, t)
    pad = kernel_size // 2
    if pooling == "max":
        y = F.max_pool1d(x, kernel_size, stride=1, padding=pad)
    else:
        y = F.avg_pool1d(x, kernel_size, stride=1, padding=pad, count_include_pad=False)
    return y.reshape(l, h, t)
