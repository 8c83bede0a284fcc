"""``accum``: attention received from every later query, divided by how many queries could see
the token (plain H2O sums favour early tokens just for being early)."""

from __future__ import annotations

import torch

from .base import Scorer, ScorerInput


def accum_normalised(accum: torch.Tensor) -> torch.Tensor:
    t = accum.shape[-1]
    seen_by = torch.arange(t, 0, -1, dtype=torch.float32)  # token i is visible to T - i queries
    return accum.float() / seen_by


class AccumScorer(Scorer):
    name = "accum"
    stats = ("accum",)

    def score(self, inputs: ScorerInput) -> torch.Tensor:
        return accum_normalised(inputs.stats["accum"])
