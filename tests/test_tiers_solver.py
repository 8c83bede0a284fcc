"""The tier solver against brute force on tiny instances (fixed seeds)."""

from __future__ import annotations

import pytest
import torch

from kdnctl.allocate.tiers import solve_brute, solve_greedy, total

COST = torch.tensor([256.0, 144.0, 80.0, 64.0, 48.0])  # fp16, int8, int4, int3, int2 per token


def _instance(seed: int, n: int, k: int):
    g = torch.Generator().manual_seed(seed)
    cost = COST[:k]
    err = torch.sort(torch.rand(n, k, generator=g), dim=1).values  # error grows as bits shrink
    err[:, 0] = 0.0
    w = torch.rand(n, 1, generator=g) ** 2
    return err * w, cost


@pytest.mark.parametrize("seed", range(12))
def test_greedy_close_to_brute_force(seed):
    n, k = 5, 4
    damage, cost = _instance(seed, n, k)
    lo, hi = float(cost.min()) * n, float(cost.max()) * n
    for frac in (0.0, 0.15, 0.4, 0.7, 1.0):
        cap = lo + frac * (hi - lo)
        got = solve_greedy(damage, cost, cap)
        best = solve_brute(damage, cost, cap)
        d_got, c_got = total(damage, cost, got)
        d_best, _ = total(damage, cost, best)
        assert c_got <= cap + 1e-6
        # greedy over convex hulls is within one upgrade's damage of the optimum
        assert d_got <= d_best + float(damage.max()) + 1e-9
        if frac == 1.0:
            assert d_got == pytest.approx(d_best)  # everything fits: the best tier everywhere


def test_exact_when_a_hull_prefix_fills_the_cap():
    damage = torch.tensor([[0.0, 0.1, 1.0], [0.0, 0.05, 0.2], [0.0, 0.3, 0.9]])
    cost = torch.tensor([3.0, 2.0, 1.0])
    cap = 3 * 1.0 + 1.0 + 1.0  # room for two one-byte upgrades: units 0 and 2 gain the most
    got = solve_greedy(damage, cost, cap)
    assert got.tolist() == solve_brute(damage, cost, cap).tolist() == [1, 2, 1]


def test_infeasible_and_dominated_tiers():
    damage = torch.tensor([[0.0, 0.3, 0.2]])  # tier 1 costs more than tier 2 and is worse
    cost = torch.tensor([4.0, 2.0, 1.0])
    assert solve_greedy(damage, cost, 0.5) is None
    assert solve_greedy(damage, cost, 2.5).tolist() == [2]  # never the dominated tier
    assert solve_greedy(damage, cost, 4.0).tolist() == [0]


def test_per_unit_costs():
    damage = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    cost = torch.tensor([[10.0, 1.0], [3.0, 1.0]])  # unit 1's upgrade is cheaper: same gain
    got = solve_greedy(damage, cost, 4.0)
    assert got.tolist() == [1, 0]
    assert total(damage, cost, got)[1] <= 4.0


def test_non_convex_unit_is_upgraded_along_its_hull():
    """A unit whose middle tier is a poor deal jumps straight to the better one."""
    damage = torch.tensor([[0.0, 0.5, 0.9]])
    cost = torch.tensor([3.0, 2.0, 1.0])
    assert solve_greedy(damage, cost, 3.0).tolist() == [0]
    assert solve_greedy(damage, cost, 2.0).tolist() == [1]  # the hull segment does not fit
