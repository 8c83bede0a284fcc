"""Ranks scaled to [0, 1]: puts scorers, heads and layers with different scales on par."""

from __future__ import annotations

import torch


def rank01(x: torch.Tensor, *, stable: bool = False) -> torch.Tensor:
    """Ranks of ``x`` along its last axis divided by ``T - 1`` (0 = lowest). ``stable`` breaks ties
    by position, so equal scores keep their order."""
    t = x.shape[-1]
    ranks = x.float().argsort(dim=-1, stable=stable).argsort(dim=-1, stable=stable).float()
    return ranks / max(t - 1, 1)
