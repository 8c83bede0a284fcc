"""``window``: attention from the last W queries of the document, captured at ingest (SnapKV)."""

from __future__ import annotations

import torch

from .base import Scorer, ScorerInput


class WindowScorer(Scorer):
    name = "window"
    stats = ("window",)

    def score(self, inputs: ScorerInput) -> torch.Tensor:
        return inputs.stats["window"].float()
