"""Quantize: the keys and values transformed for coding, their per-channel steps, and the codes
at one scale.

The quantizer (``kdnctl.quant.entropy.EntropyQuantizer``) takes the RoPE off the keys; a
channel's step is relative to its weight (the precision stage) and floored where its codes would
outgrow ec's range; with ``layers="fisher"`` each layer's and role's steps are first scaled by
how much its error costs the model (``kdnctl.allocate.layer_fisher``, from the model's profile
where the store has one: ``kdnctl.allocate.fisher_profile``); ``key_weight`` W makes
every key step ``1/sqrt(W)`` of its value-relative size. ``codes_at`` codes every chunk at one
scale of those steps; the encode stage fits that scale to the byte cap.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor

import torch

from ...allocate import fisher_profile as fpro
from ...allocate import layer_fisher as lf
from ...allocate.rate import clamp_steps, relative_steps, step_floor
from ...errors import UsageError
from ...format.names import held_rows, tensor_name
from ...quant import transforms as tf
from ...quant.entropy import encode_role
from ...quant.grid import roundtrip_role
from ...presses.window_layers import ec_windows, first_row
from ..feedback import feedback_values
from .base import Job, Stage


ENCODE_WORKERS = 2  # threads over chunks while encoding
FEEDBACK_WORKERS = 2  # threads over layers while rounding values with feedback


def narrow_heads(recipe, n_layers: int, n_heads: int) -> dict[int, list[int]]:
    """Backfilled layer -> its KV heads that do NOT read the evicted tokens (``backfill`` "L.H")."""
    out = {}
    for i, wide in recipe.backfill_heads.items():
        if wide is None or i >= n_layers:
            continue
        if max(wide) >= n_heads:
            raise UsageError(f"option backfill names KV head {max(wide)} of layer {i}; the model has {n_heads} KV heads",
                             hint=f"heads are 0 to {n_heads - 1}", param="backfill")
        out[i] = [h for h in range(n_heads) if h not in wide]
    return out


def hide_rows(x: torch.Tensor, heads: list[int], evicted: torch.Tensor, bounds) -> None:
    """In place: ``x [H, T, D]``'s ``evicted`` rows of ``heads`` set to the mean of their chunk's
    other rows, so they quantize to codes of 0 and leave the chunk's mean as it was."""
    for ls, le in bounds:
        ev = evicted[ls:le]
        for h in heads:
            rows = x[h, ls:le]
            rows[ev] = rows[~ev].mean(0) if bool((~ev).any()) else 0.0


def decoded_keys(x: torch.Tensor, step: torch.Tensor, levels: torch.Tensor, bounds, basis: torch.Tensor | None,
                 positions: torch.Tensor, theta: float | None) -> torch.Tensor:
    """RoPE'd keys ``[H, T, D]`` as the loader decodes ec's transformed keys ``x`` coded at
    ``step`` chunk by chunk (``bounds``: each chunk's ``[start, end)`` in ``x``)."""
    k = torch.cat([roundtrip_role(x[:, a:b], step, levels[a:b], basis) for a, b in bounds], 1)
    return tf.rope(k, positions, theta) if theta else k


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread inside the block (small per-layer ops; on a machine shared with
    other jobs a fork-join waits for a descheduled thread)"""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def steps_at(job: Job, alpha: float, i: int):
    """Layer i's (key, value) steps at scale ``alpha``."""
    return tuple(clamp_steps(alpha * b, f) for b, f in zip(job.base[i], job.floors[i]))


def codes_at(job: Job, alpha: float, feedback: bool = False, kept_keys=None, own_widths: bool = True
             ) -> list[dict[str, torch.Tensor]]:
    """Every chunk's codes and params at scale ``alpha``. With ``feedback`` the values are rounded
    with feedback at these steps (``refit_feedback``; the sizes are fitted without it: the same
    grid, codes a little apart). ``own_widths``: see ``entropy.encode_codes``."""
    with one_torch_thread():  # hundreds of small tensors: fork-join costs more than it gives
        return _codes_at(job, alpha, feedback, kept_keys, own_widths)


def _codes_at(job: Job, alpha: float, feedback: bool, kept_keys, own_widths: bool) -> list[dict[str, torch.Tensor]]:
    recipe, xs, basis = job.recipe, job.xs, job.basis
    def fed_layer(i: int) -> torch.Tensor:
        return feedback_values(job.fit_queries[0][i], kept_keys[i] if kept_keys else job.keys[i], xs[i][1],
                               job.fit_queries[1][i], recipe.refit, steps_at(job, alpha, i)[1], job.levels_by_role[1],
                               job.kept_bounds, job.hold)

    fed = None
    if feedback:  # layers on both cores, one torch thread each: the same arithmetic as one by one
        with ThreadPoolExecutor(FEEDBACK_WORKERS) as pool:
            fed = list(pool.map(fed_layer, range(job.n_layers)))

    def one_chunk(bounds):
        (ks, ke), (ls, le) = bounds
        chunk = {}
        for i, (k, v) in enumerate(xs):
            for role, x, s, fl, rl in zip(("keys", "values"), (k, v), steps_at(job, alpha, i), job.full_levels,
                                          job.levels_by_role):
                a, b, lv = (ls, le, fl[ls:le]) if i in job.backfill else (ks, ke, rl[ks:ke])
                if i in job.wins:  # a window layer codes only its window's rows
                    a = first_row(job.wins, i, ks, ke)
                    lv = rl[a:ke]
                axes = basis[i] if basis is not None and role == "keys" else None
                rows_here = held_rows(~job.evicted[ls:le], job.narrow_mask[i]) if i in job.narrow else None
                mean = None
                if fed is not None and role == "values":  # the grid is centred where plain rounding's is
                    x, mean = fed[i], x[:, a:b].mean(1)
                chunk[tensor_name(i, f"{role}.codes")], chunk[tensor_name(i, f"{role}.params")] = \
                    encode_role(x[:, a:b], s, lv, job.quantizer.coding, basis=axes, stored=rows_here, mean=mean,
                                own_widths=own_widths)
        return chunk

    # chunks on both cores: deflate and torch's kernels release the GIL (the same bytes, in order)
    with ThreadPoolExecutor(ENCODE_WORKERS) as pool:
        return list(pool.map(one_chunk, zip(job.kept_bounds, job.local_bounds)))


class Quantize(Stage):
    """The transformed layers (``xs``), the backfill's narrow heads, and each layer's relative
    steps and floors."""

    name = "quantize"

    def run(self, job: Job) -> None:
        recipe, q, rows, backfill, shifts = job.recipe, job.quantizer, job.rows, job.backfill, job.shifts
        n_heads, n_all, d = job.all_keys[0].shape
        job.xs = [q.forward(job.all_keys[i], job.all_values[i], job.all_positions.expand(n_heads, -1)) if i in backfill
                  else q.forward(k, v, job.positions.expand(n_heads, -1))
                  for i, (k, v) in enumerate(zip(job.keys, job.values))]
        job.narrow = {i: h for i, h in narrow_heads(recipe, job.n_layers, n_heads).items() if i in backfill}
        job.wins, job.win_meta = ec_windows(recipe, job.bundles[0].meta["model"], job.positions,
                                            int(job.all_positions[-1]) + 1, bool(backfill))
        job.evicted = torch.ones(n_all, dtype=torch.bool)
        if rows is not None:
            job.evicted[rows] = False
        job.narrow_mask = {i: torch.isin(torch.arange(n_heads), torch.tensor(h)) for i, h in job.narrow.items()}
        for i, heads in job.narrow.items():
            job.xs[i] = tuple(x.clone() for x in job.xs[i])  # the transform may hand back the caller's tensor
            for x in job.xs[i]:
                hide_rows(x, heads, job.evicted, job.local_bounds)
        # a backfilled layer's steps are those of its kept tokens: 2**shift x the level-0 step. A key
        # error weighted key_weight x a value error's: a uniform step's error grows as its square, so
        # at equal slope the keys' steps are 1/sqrt(key_weight) x theirs
        roles = ((job.key_weights, recipe.key_weight ** -0.5), (job.value_weights, 1.0))
        job.base = [tuple(relative_steps(x[:, rows] if i in backfill else x, w[i]) * m * (2.0 ** s if i in backfill else 1)
                          for x, (w, m), s in zip(job.xs[i], roles, shifts)) for i in range(job.n_layers)]
        # rotated rows reach sqrt(D) x a channel's largest code: the keys' floors make room for that
        widen = (d ** 0.5 if job.basis is not None else 1.0, 1.0)
        job.floors = [tuple(step_floor(x, job.finest + (s if i in backfill else 0)) * wd
                            for x, s, wd in zip(job.xs[i], shifts, widen)) for i in range(job.n_layers)]
        n_tokens = job.keys[0].shape[1]
        if recipe.layers == "fisher" and n_tokens > job.header:
            fisher = self.layer_fisher(job, d)
            job.mult = lf.layer_multipliers(lf.layer_damage(fisher, job.base))
            job.base = [(k * job.mult[i, 0], v * job.mult[i, 1]) for i, (k, v) in enumerate(job.base)]

    @staticmethod
    def layer_fisher(job: Job, head_dim: int):
        """Per layer (keys, values) ``[H, D]``: the model's Fisher profile where the store has one
        (kdnctl/compress/layer_profile.py), else the document's own estimate."""
        profile = fpro.profile_for(getattr(job.lm, "fingerprint", None))
        if profile is not None:
            return fpro.as_layers(fpro.check(profile, job.n_layers, job.keys[0].shape[0], head_dim, "Fisher profile"))
        probe = lf.probe_ids(job.lm, job.token_ids, job.header)  # the document's own text, over the kept tokens' cache
        return lf.channel_fisher(job.lm, job.keys, job.values, probe, int(job.positions.max()) + 1,
                                 0.25 ** job.levels.float(), job.recipe.seed)
