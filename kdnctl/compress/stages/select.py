"""Select tokens: the kept set of an evicting ``ec`` version, chosen by the recipe's press.

ec keeps one set of tokens, the same in every layer and KV head: the recipe's press wrapped in
``shared`` (``kdnctl.presses.shared``) ranks the tokens by its scores averaged over layers and
heads, the prompt header and the last ``protect`` tokens forced among them. With ``tail_reads``
the last share of the set follows a second order, what the end of the document reads
(``kdnctl.scorers.tail_reads``).
"""

from __future__ import annotations

import torch

from ...errors import UsageError
from ...presses.base import ScoreContext
from ...presses.shared import SharedPress
from ...scorers.tail_reads import tail_read_scores
from .base import Job, Stage


def lift_top(lift: torch.Tensor, share: float) -> torch.Tensor:
    """The ``share`` of the tokens ranked highest by ``lift`` (``[L, H, T]`` ranks, averaged;
    ties to the earlier token): the tokens ``lift`` lifts."""
    return torch.argsort(-lift.float().mean((0, 1)), stable=True)[: int(share * lift.shape[-1])]


def shared_press(header: int, protect: int, press: str = "kvcrush", press_options: dict | None = None) -> SharedPress:
    """``press`` wrapped in ``shared``: its scores averaged over layers and heads, the first
    ``header`` and the last ``protect`` tokens forced."""
    return SharedPress(sink_tokens=header, recent_tokens=protect, press=press,
                       press_options={**(press_options or {}), "sink_tokens": header, "recent_tokens": protect},
                       by="mean", keep_last=False)


def shared_keep(importance: torch.Tensor, keep: float, header: int, protect: int,
                second: torch.Tensor | None = None, share: float = 0.0, press: SharedPress | None = None,
                ctx: ScoreContext | None = None) -> torch.Tensor:
    """Ascending document indices of the ``round(keep * T)`` tokens ``press`` (default: the
    importance itself, averaged over layers and heads; ties to the earlier token) keeps, the
    first ``header`` and the last ``protect`` tokens always among them. With ``second`` (``[T]``,
    e.g. ``tail_reads.tail_read_scores``), the last ``share`` of the tokens beyond the forced
    ones are the best of ``second`` among those not yet kept."""
    press = press or shared_press(header, protect)
    ctx = ctx or ScoreContext(importance=importance)
    n, n_layers = ctx.n_tokens, ctx.n_layers
    n_forced = int(press.forced_indices(n, n).numel())
    want = max(int(round(keep * n)), n_forced)
    first = want if second is None or share <= 0 else n_forced + round((1 - share) * (want - n_forced))
    kept = press.select(ctx, [first] * n_layers)[0][0] if n_layers else torch.zeros(0, dtype=torch.int64)
    if first == want:
        return kept
    taken = set(kept.tolist())
    rest = [t for t in sorted(range(n), key=lambda t: (-float(second[t]), t)) if t not in taken]
    return torch.tensor(sorted(taken | set(rest[:want - first])), dtype=torch.int64)


class SelectTokens(Stage):
    """Evicting recipes (``keep`` < 1): the kept rows, the keys (and, without a refit, the values)
    cut to them, and the lifted tokens the refit holds."""

    name = "select"

    def run(self, job: Job) -> None:
        recipe = job.recipe
        if recipe.keep >= 1:
            return
        if job.importance is None:
            raise UsageError("--quant ec with --keep needs a scorer to rank tokens", param="keep")
        second = tail_read_scores(job.lm, job.token_ids) if recipe.tail_reads else None
        press = shared_press(job.header, recipe.protect, recipe.press, recipe.press_options)
        ctx = ScoreContext(importance=job.importance, keys=job.all_keys, values=job.all_values, stats=job.stats,
                           seed=recipe.seed)
        job.rows = shared_keep(job.importance, recipe.keep, job.header, recipe.protect, second,
                               recipe.tail_reads or 0.0, press=press, ctx=ctx)
        job.keys = [k[:, job.rows] for k in job.keys]
        job.lift = job.lift[..., job.rows] if job.lift is not None else None
        if recipe.refit_hold:  # the recipe has a lift (checked there)
            job.hold = torch.zeros(job.rows.numel(), dtype=torch.bool)
            job.hold[lift_top(job.lift, recipe.lift_steps[0])] = True
        if not recipe.refit:
            job.values = [v[:, job.rows] for v in job.values]
