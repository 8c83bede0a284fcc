"""``surprisal``: the model's own -log p(token | prefix) at ingest, the same for every head:
surprising tokens carry the information a later question asks about."""

from __future__ import annotations

import torch

from .base import Scorer, ScorerInput


class SurprisalScorer(Scorer):
    name = "surprisal"
    stats = ("surprisal",)

    def score(self, inputs: ScorerInput) -> torch.Tensor:
        return inputs.per_token(inputs.stats["surprisal"].float())
