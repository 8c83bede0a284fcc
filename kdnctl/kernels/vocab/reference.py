"""The torch logsumexp of ``x @ weight.T (+ bias)`` over the vocabulary, in vocabulary tiles."""

from __future__ import annotations

import torch

VOCAB_TILE = 8192  # vocabulary rows per projection: a tile of logits at a time, not all of them


def vocab_logsumexp(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    tile: int = VOCAB_TILE) -> torch.Tensor:
    """``x [m, d]`` and ``weight [V, d]`` (same dtype) -> ``[m]`` fp32 logsumexp of the logits.

    The logsumexp runs over vocabulary tiles (then over the tiles' results): the same fp32
    logsumexp, without a ``[m, V]`` fp32 tensor that leaves the cache between passes."""
    parts = []
    for s in range(0, weight.shape[0], tile):
        logits = torch.nn.functional.linear(x, weight[s : s + tile])
        if bias is not None:
            logits = logits + bias[s : s + tile].to(x.dtype)
        parts.append(torch.logsumexp(logits.float(), dim=-1))
    return torch.logsumexp(torch.stack(parts, dim=-1), dim=-1)
