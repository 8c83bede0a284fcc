"""KNorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression", arXiv 2406.11430): keep the tokens whose KEY has the LOWEST L2 norm.

The paper's finding is that a low key norm correlates with high attention received (the
attention-sink tokens have conspicuously small key norms), so the score is the negated
norm. It needs no attention statistics at all, only the (post-RoPE) keys; RoPE is a
rotation per pair of dimensions and leaves the norm unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kdnctl.errors import UnsupportedError
from kdnctl.presses.base import Press, ScoreContext


@dataclass
class KNormPress(Press):
    name: ClassVar[str] = "knorm"

    def score(self, ctx: ScoreContext) -> Tensor:
        if ctx.keys is None:
            raise UnsupportedError(
                "press 'knorm' needs the keys, which were not provided",
                hint="use a bundle with dense (or quantized) keys",
            )
        norms = torch.stack([k.float().norm(dim=-1) for k in ctx.keys])  # [L, H, T]
        return -norms
