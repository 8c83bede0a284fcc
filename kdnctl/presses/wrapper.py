"""Shared plumbing of the per-layer budget wrappers (``pyramid``, ``adaptive``): they wrap any
press, keep its scoring and selection, and change only how the quota is split over layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import Tensor

from kdnctl.errors import UsageError
from kdnctl.presses.base import Press, ScoreContext


@dataclass
class LayerBudgetWrapper(Press):
    name: ClassVar[str] = "wrapper"

    press: Any = "snapkv"  # name or Press instance
    press_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.press, Press):
            self.inner = self.press
            # the wrapped press owns the forced tokens; mirror them so callers see one truth
            self.sink_tokens = self.inner.sink_tokens
            self.recent_tokens = self.inner.recent_tokens
        else:
            from kdnctl.presses import get_press  # late: the registry imports this module

            opts = {"sink_tokens": self.sink_tokens, "recent_tokens": self.recent_tokens}
            opts.update(self.press_options)
            self.inner = get_press(str(self.press), **opts)
        if isinstance(self.inner, LayerBudgetWrapper):
            raise UsageError(f"{self.name} cannot wrap another per-layer budget press ({self.inner.name})")

    @property
    def uses_importance(self) -> bool:  # type: ignore[override]
        return self.inner.uses_importance

    def score(self, ctx: ScoreContext) -> Tensor:
        return self.inner.score(ctx)

    def select(self, ctx: ScoreContext, quotas: list[int], *, keep_sinks: bool = True,
               keep_recent: bool = True) -> list[Tensor]:
        return self.inner.select(ctx, quotas, keep_sinks=keep_sinks, keep_recent=keep_recent)
