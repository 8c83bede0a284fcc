"""The spec of ``channel_var``: torch's population variance over the tokens (on the CPU it
accumulates a float32 tensor's moments in float64, then rounds to float32)."""

from __future__ import annotations

import torch


def channel_var(x: torch.Tensor) -> torch.Tensor:
    """``x [H, T, D]`` -> ``[H, D]``."""
    return x.var(1, unbiased=False)
