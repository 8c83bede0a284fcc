"""The scorer interface: a query-agnostic guess of which stored tokens a future question needs.

A scorer is a small class with one ``score(inputs)`` returning ``[L, H_kv, T]`` (higher = keep);
``stats`` names the ingest statistics it reads, ``needs_model`` whether it runs the model or
its tokenizer. The registry (``kdnctl.scorers.SCORERS``) finds it by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


@dataclass
class ScorerInput:
    """One document as a scorer sees it: ingest statistics (``window``/``accum`` ``[L, H, T]``,
    ``surprisal`` ``[T]``), the loaded model or None, dense keys/values per layer ``[H, T, D]``,
    the token ids and the cache's shape."""

    stats: dict[str, torch.Tensor]
    n_layers: int
    n_heads: int
    lm: Any = None
    keys: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    token_ids: list[int] | None = field(default=None)

    def per_token(self, score: torch.Tensor) -> torch.Tensor:
        """A ``[T]`` score, the same in every layer and KV head: ``[L, H, T]``."""
        return score.expand(self.n_layers, self.n_heads, -1).clone()


class Scorer:
    """Base of every scorer."""

    name: ClassVar[str] = "base"
    stats: ClassVar[tuple[str, ...]] = ()  # ingest statistics it reads
    needs_model: ClassVar[bool] = False
    needs: ClassVar[str] = "the model"  # what it asks of the model, for the error without one

    def score(self, inputs: ScorerInput) -> torch.Tensor:
        raise NotImplementedError
