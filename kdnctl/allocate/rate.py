"""Rate allocation of the entropy-coded ``ec`` layout: per-channel steps under a byte cap.

For a squared error weighted by ``w_c`` (``kdnctl.quant.sensitivity``) and an entropy-coded
uniform quantizer, the high-rate optimum gives every channel the same weighted error, i.e. a
step proportional to ``1 / sqrt(w_c)``; channels whose spread is below their step get (almost)
no bits, which is reverse water-filling. Across heads and layers the steps are normalised so
every head has the same error relative to its own weighted energy (as a fixed-rate quantizer
has), and one global scale ``alpha`` sets the rate: :func:`fit_scale` finds the finest scale
whose encoded bytes fit the cap (bytes fall as the scale grows).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

STEP_MIN, STEP_MAX = 1e-4, 6e4  # float16-representable steps
CODE_MAX = 30000  # int16 codes, with room


def relative_steps(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Base steps ``[H, D]`` of one role of one layer (``x [H, T, D]`` transformed, ``w [H, D]``):
    ``step_c = s_h / sqrt(w_c)`` with ``s_h^2 = mean_c(w_c * var_c)``, so at scale ``alpha`` every
    head's weighted squared error is ``alpha^2 / 12`` of its weighted variance."""
    var = x.var(1, unbiased=False) if x.shape[1] else torch.zeros_like(w)
    w = w.clamp_min(0)
    s = (w * var).mean(-1, keepdim=True).sqrt()
    base = s / w.clamp_min(1e-12).sqrt()
    return base.nan_to_num(STEP_MAX, STEP_MAX, STEP_MAX)


def clamp_steps(step: torch.Tensor, x: torch.Tensor, finest_level: int) -> torch.Tensor:
    """Steps within float16's range and coarse enough that every code fits int16 at the
    finest token level."""
    spread = (x - x.mean(1, keepdim=True)).abs().amax(1) if x.shape[1] else torch.zeros_like(step)
    floor = (spread * 2 ** finest_level / CODE_MAX).clamp_min(STEP_MIN)
    return torch.maximum(step, floor).clamp_max(STEP_MAX)


def fit_scale(size_at: Callable[[float], int], cap: float, lo: float = 1 / 64, hi: float = 64.0,
              iters: int = 14) -> float | None:
    """The smallest ``alpha`` in ``[lo, hi]`` with ``size_at(alpha) <= cap`` (bisection in log
    space, to within a factor ``(hi / lo) ** 2 ** -iters``: 0.05% by default; ``size_at`` falls as
    ``alpha`` grows); None if even ``hi`` does not fit."""
    if size_at(hi) > cap:
        return None
    if size_at(lo) <= cap:
        return lo
    a, b = math.log(lo), math.log(hi)
    for _ in range(iters):
        m = (a + b) / 2
        if size_at(math.exp(m)) <= cap:
            b = m
        else:
            a = m
    return math.exp(b)
