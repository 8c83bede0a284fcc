"""The token loop of rounding with error feedback in torch: the spec ``cpu.round_tokens`` is held to."""

from __future__ import annotations

import torch


def round_tokens(w: torch.Tensor, u: torch.Tensor, m: torch.Tensor, dv: torch.Tensor, q: torch.Tensor) -> None:
    """In place: ``w [S, D]`` (float64, in rounding order) rounded row by row into ``q`` on the
    grid ``m + k * dv``, each row's error carried into the rows after it through ``u [S, S]``."""
    s = w.shape[0]
    for i in range(s):
        q[i] = m + torch.round((w[i] - m) / dv[i]) * dv[i]
        if i + 1 < s:
            w[i + 1:] -= u[i, i + 1:, None] * ((w[i] - q[i]) / u[i, i])[None]
