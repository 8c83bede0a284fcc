"""Precision tiers under a byte cap: which tier each token (per layer and KV head) is stored at.

Problem: units ``u`` (one token of one layer and KV head), tiers ``k`` with a byte cost
``cost[u, k]`` and an expected damage ``damage[u, k]`` (importance x the tier's measured
reconstruction error for that token). Choose one tier per unit to minimise the total damage
with the total cost <= ``cap``. This is a multiple-choice knapsack; :func:`solve_greedy` is the
classic greedy over each unit's lower convex hull:

1. every unit starts at its cheapest tier (if even that exceeds the cap the problem is
   infeasible: the caller must evict tokens first, see ``kdnctl.compress.sizing``);
2. each unit's upgrades along its convex hull (dominated tiers dropped) are segments with a
   damage saved per byte; hull slopes decrease along a unit, so sorting all segments by that
   ratio and taking them in order never takes a unit's segment before the one it builds on;
3. segments are taken while they fit; once one does not fit, that unit takes the best
   off-hull tier that still fits (if any) and stops; other units' upgrades fill what is left.

The result is within one segment's damage of the LP optimum, hence of the integer optimum
(tests compare it with :func:`solve_brute` on tiny instances).
"""

from __future__ import annotations

import itertools

import torch


def _segments(damage: torch.Tensor, cost: torch.Tensor):
    """Hull segments of every unit (tiers ordered by the first unit's costs: every unit must
    rank the tiers' costs alike). Returns (cost order, unit, to-tier, dcost, ddamage, rank)."""
    n, k = damage.shape
    order = torch.argsort(cost[0] if cost.dim() == 2 else cost)
    c = (cost if cost.dim() == 2 else cost.expand(n, -1)).double()
    d = damage.double()
    c, d = c.gather(1, order.expand(n, -1)), d.gather(1, order.expand(n, -1))
    # Per unit, walk the hull in pure torch: at each step pick the tier with the best slope.
    cur = torch.zeros(n, dtype=torch.long)
    units, tos, dcs, dds, ranks = [], [], [], [], []
    ar = torch.arange(n)
    for step in range(k - 1):
        cc, dc = c[ar, cur][:, None], d[ar, cur][:, None]
        later = torch.arange(k)[None, :] > cur[:, None]
        gain = (dc - d) / (c - cc).clamp_min(1e-12)
        gain = torch.where(later & (d < dc) & (c > cc), gain, torch.full_like(gain, -1.0))
        best = gain.argmax(1)  # the steepest next hull point (a tie continues at the next step)
        ok = gain[ar, best] > 0
        if not bool(ok.any()):
            break
        u = ar[ok]
        units.append(u)
        tos.append(best[ok])
        dcs.append((c[ar, best] - c[ar, cur])[ok])
        dds.append((d[ar, cur] - d[ar, best])[ok])
        ranks.append(torch.full((int(ok.sum()),), step, dtype=torch.long))
        cur = torch.where(ok, best, cur)
    if not units:
        empty = torch.zeros(0, dtype=torch.long)
        return order, empty, empty, empty.double(), empty.double(), empty
    to = order[torch.cat(tos)]
    return order, torch.cat(units), to, torch.cat(dcs), torch.cat(dds), torch.cat(ranks)


def solve_greedy(damage: torch.Tensor, cost: torch.Tensor, cap: float) -> torch.Tensor | None:
    """Tier index per unit (int64 ``[U]``) minimising damage under ``cap``; None if infeasible.

    ``damage [U, K]``; ``cost [K]`` (same for every unit) or ``[U, K]``."""
    if damage.dim() != 2 or cost.shape[-1] != damage.shape[1]:
        raise ValueError(f"damage [U, K] and cost [K] or [U, K] expected, got {tuple(damage.shape)}, {tuple(cost.shape)}")
    n = damage.shape[0]
    order, units, to, dc, dd, rank = _segments(damage, cost)
    base = order[0]
    base_cost = float(cost[base]) * n if cost.dim() == 1 else float(cost[:, base].double().sum())
    if base_cost > cap + 1e-9:
        return None
    tier = torch.full((n,), int(base), dtype=torch.long)
    if units.numel() == 0:
        return tier
    ratio = dd / dc
    # by ratio (desc), then by hull rank so a unit's segments stay in order on ties
    key = torch.argsort(rank, stable=True)
    key = key[torch.argsort(-ratio[key], stable=True)]
    units, to, dc = units[key], to[key], dc[key]
    left = cap - base_cost
    csum = torch.cumsum(dc, 0)
    fit = int(torch.searchsorted(csum, torch.tensor(left, dtype=torch.float64), right=True))
    tier[units[:fit]] = to[:fit]  # later segments of a unit overwrite earlier ones (same order)
    left -= float(csum[fit - 1]) if fit else 0.0
    stopped = set()
    steps = torch.diff(torch.sort(cost.double(), dim=-1).values, dim=-1)
    dc_min = float(steps[steps > 0].min()) if bool((steps > 0).any()) else 0.0  # smallest upgrade of any kind
    for j in range(fit, min(units.numel(), fit + 50_000)):  # fill what is left with upgrades that fit
        if left < dc_min:
            break
        u = int(units[j])
        if u in stopped:
            continue
        if float(dc[j]) <= left + 1e-9:
            tier[u] = to[j]
            left -= float(dc[j])
        else:  # the hull step does not fit: the best off-hull tier that does, if any
            stopped.add(u)
            cu = cost if cost.dim() == 1 else cost[u]
            extra = cu.double() - float(cu[tier[u]])
            ok = (extra <= left + 1e-9) & (damage[u] < damage[u, tier[u]])
            if bool(ok.any()):
                k = int(torch.where(ok, damage[u].double(), torch.tensor(float("inf"), dtype=torch.float64)).argmin())
                left -= float(extra[k])
                tier[u] = k
    return tier


def total(damage: torch.Tensor, cost: torch.Tensor, tier: torch.Tensor) -> tuple[float, float]:
    """(total damage, total cost) of an assignment."""
    ar = torch.arange(damage.shape[0])
    c = cost[tier] if cost.dim() == 1 else cost[ar, tier]
    return float(damage[ar, tier].double().sum()), float(c.double().sum())


def solve_brute(damage: torch.Tensor, cost: torch.Tensor, cap: float) -> torch.Tensor | None:
    """Exhaustive optimum for tiny instances (the reference the greedy is tested against)."""
    n, k = damage.shape
    best, best_d = None, float("inf")
    for combo in itertools.product(range(k), repeat=n):
        t = torch.tensor(combo)
        d, c = total(damage, cost, t)
        if c <= cap + 1e-9 and d < best_d - 1e-12:
            best, best_d = t, d
    return best
