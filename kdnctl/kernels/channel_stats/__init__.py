"""Each channel's variance over the tokens of a ``[H, T, D]`` tensor (the rate allocation's base
steps): compiled on the host (``cpu.py``), torch's ``var`` elsewhere (``reference.py``, the spec)."""

from __future__ import annotations

import torch

from . import reference


def channel_var(x: torch.Tensor) -> torch.Tensor:
    """``x [H, T, D]`` -> ``[H, D]``: the population variance over ``T`` (``x.var(1, unbiased=False)``)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 3 and x.shape[1]:
        from . import cpu

        return torch.from_numpy(cpu.channel_var(x.contiguous().numpy()))
    return reference.channel_var(x)
