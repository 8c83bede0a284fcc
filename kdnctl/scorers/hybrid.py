"""``hybrid`` (the default scorer): the equal-weight rank average of ``reconstruct`` and
``surprisal``, the two offline signals. Measured with ``kdnctl eval`` (``bench/compress.py``)
against each scorer alone and against a mix that also used ``window``: the last-window
attention was the worst single scorer, and the mix without it keeps more of what answers need."""

from __future__ import annotations

import torch

from . import reconstruct
from .base import Scorer, ScorerInput
from .rank import rank01


class HybridScorer(Scorer):
    name = "hybrid"
    stats = ("surprisal",)
    needs_model = True

    def score(self, inputs: ScorerInput) -> torch.Tensor:
        recon = reconstruct.reconstruct_scores(inputs.lm, inputs.keys, inputs.values, inputs.token_ids)
        surprisal = rank01(inputs.stats["surprisal"].float()).expand(inputs.n_layers, inputs.n_heads, -1)
        return 0.5 * rank01(recon) + 0.5 * surprisal
