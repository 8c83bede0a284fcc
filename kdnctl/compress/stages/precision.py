"""Allocate precision: how fine each token and each channel is stored, relative to the rest.

Per token a level (``2**level`` times finer steps): the prompt header and the last ``protect``
tokens at ``protect_level``, the top share of the tokens by ``lift`` at its level, the rest at 0;
with ``backfill`` the named layers also keep the evicted tokens, at level 0 and the kept ones
shifted up. Per channel a weight from how much attention depends on it
(``kdnctl.quant.sensitivity``: query energy for keys, the output projection's column norms for
values); the quantize stage turns weights into steps.
"""

from __future__ import annotations

import torch

from ...quant.entropy import MAX_LEVEL
from ...quant.sensitivity import key_weights, recorded_key_weights, value_weights
from ..options import LIFT_LEVEL, LIFT_SHARE, PROTECT_LEVEL
from .base import Job, Stage
from .select import lift_top


def token_levels(n_tokens: int, header: int, protect: int, lift: torch.Tensor | None = None,
                 protect_level: int = PROTECT_LEVEL, lift_steps: tuple[float, int] = (LIFT_SHARE, LIFT_LEVEL)) -> torch.Tensor:
    """Per token: ``protect_level`` for the prompt header and the last ``protect`` tokens, the
    level of ``lift_steps`` for its share of the tokens ranked highest by ``lift`` (``[L, H, T]``
    ranks, averaged; ties to the earlier token), else 0."""
    levels = torch.zeros(n_tokens, dtype=torch.uint8)
    if lift is not None and n_tokens:
        share, level = lift_steps
        levels[lift_top(lift, share)] = level
    if protect:
        levels[-protect:] = protect_level
    levels[:header] = protect_level
    return levels


class AllocatePrecision(Stage):
    """Token levels by role, the backfilled layers' levels, and the channel weights."""

    name = "precision"

    def run(self, job: Job) -> None:
        recipe, rows = job.recipe, job.rows
        n_tokens, n_all = job.keys[0].shape[1], job.all_keys[0].shape[1]
        job.all_positions = torch.cat([b.layer_positions(0)[0] for b in job.bundles])
        job.positions = job.all_positions
        if rows is not None:
            job.positions = job.positions[rows]
            # chunk c's kept tokens in the kept sequence: [kept_bounds[c][0], kept_bounds[c][1])
            job.kept_bounds = [(int((rows < ls).sum()), int((rows < le).sum())) for ls, le in job.local_bounds]
        else:
            job.kept_bounds = job.local_bounds
        levels = token_levels(n_tokens, job.header, recipe.protect, job.lift, recipe.tail_level, recipe.lift_steps)
        # lift_role keys: the values keep the unlifted levels, the keys the lifted ones (1.10)
        job.split = job.lift is not None and recipe.lift_role == "keys"
        job.levels = levels
        job.levels_by_role = (levels, token_levels(n_tokens, job.header, recipe.protect, None, recipe.tail_level)
                              if job.split else levels)
        job.backfill = [i for i in recipe.backfill_layers if i < job.n_layers] if rows is not None else []
        job.shifts = recipe.backfill_shifts if job.backfill else (0, 0)  # (keys, values)
        # per role: these layers keep every token, the evicted ones at level 0, the kept ones shifted up
        job.full_levels = []
        for shift, lv in zip(job.shifts, job.levels_by_role):
            job.full_levels.append(torch.zeros(n_all, dtype=torch.uint8))
            if job.backfill:
                job.full_levels[-1][rows] = lv + shift
        job.finest = int(levels.max()) if levels.numel() else 0
        assert job.finest + max(job.shifts) <= MAX_LEVEL
        n_heads, d = job.all_keys[0].shape[0], job.all_keys[0].shape[2]
        rope = job.theta is not None
        # from ingest's own prefill where its chunks recorded them, else one forward now; a refit
        # that ran that forward for its queries keeps the weights it measured
        job.key_weights = recorded_key_weights(job.lm, job.bundles, len(job.token_ids), rope) \
            if job.fit_queries is None or job.queries_read_cache else None
        if job.key_weights is None:
            job.key_weights = key_weights(job.lm, job.token_ids, job.n_layers, n_heads, d, rope=rope)
        job.value_weights = value_weights(job.lm, job.n_layers, n_heads, d)
