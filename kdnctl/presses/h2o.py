"""H2O, "Heavy-Hitter Oracle" (Zhang et al., 2023, arXiv 2306.14048): keep the tokens with
the largest attention accumulated over all queries ("heavy hitters") plus a window of the
most recent tokens.

Ingest records the accumulated attention per layer and KV head as ``stats["accum"]``
``[L, H, T]``. The paper splits the cache evenly between heavy hitters and recent tokens;
``recent_ratio`` (default 0.5) reproduces that split per layer quota, and a fixed
``recent_tokens`` count overrides it when larger. Recent tokens are counted inside the quota.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import Tensor

from kdnctl.errors import UsageError
from kdnctl.presses.base import Press, ScoreContext, round_half_up, sanitize


@dataclass
class H2OPress(Press):
    name: ClassVar[str] = "h2o"

    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= float(self.recent_ratio) <= 1.0:
            raise UsageError(f"h2o: recent_ratio must be in [0, 1], got {self.recent_ratio!r}")

    def recent_count(self, k: int) -> int:
        return max(self.recent_tokens, round_half_up(self.recent_ratio * k))

    def score(self, ctx: ScoreContext) -> Tensor:
        return sanitize(ctx.stat("accum", self.name))
