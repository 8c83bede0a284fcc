"""``fit_near``: the byte cap holds, the size lands in its window under the cap in a few
encodings on power-law sizes, and falls back to the bracketed search on steps."""

from __future__ import annotations

import math

import pytest
import torch

from kdnctl.allocate.rate import RTOL, fit_near, fit_scale


@pytest.mark.parametrize("seed", range(6))
def test_power_law_sizes_fit_in_few_encodings(seed):
    g = torch.Generator().manual_seed(seed)
    k = float(torch.rand(1, generator=g)) * 2 + 0.3  # bytes ~ alpha**-k, with a wobble
    c = float(torch.rand(1, generator=g)) * 1e6 + 1e5
    calls = []

    def size(a):
        calls.append(a)
        return int(c * a ** -k * (1 + 0.01 * math.sin(7 * math.log(a))) + 3000)

    cap = float(size(0.4 * (1 + seed / 5)))
    calls.clear()
    got = fit_near(size, cap)
    assert (1 - RTOL) * cap <= size(got) <= cap
    assert len(calls) <= 6, len(calls)


def test_step_sizes_still_fit_like_the_search():
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        knots = sorted(torch.rand(6, generator=g).tolist())

        def size(a, knots=knots):  # a falling step function: no size inside the window
            return 1000 - sum(100 for k in knots if math.log(a) > 8 * k - 4)

        cap = 1000 - 100 * int(torch.randint(1, 6, (1,), generator=g))
        got = fit_near(size, cap, guess=0.02)
        assert size(got) == size(fit_scale(size, cap))  # as many bytes as the finest scale that fits
    assert fit_near(lambda a: 10, 5) is None
    assert fit_near(lambda a: 1, 5) == 1 / 64  # fits everywhere: the finest scale, as fit_scale


@pytest.mark.parametrize("guess", [0.02, 0.3, 1.0, 40.0])
def test_fit_from_a_guess_keeps_the_search_answer(guess):
    """With a guess the search answers what it answers without one: the smallest scale that
    fits, to within its tolerance, on falling step functions (brute force on a fine grid)."""
    grid = [math.exp(-math.log(64) + i * 2 * math.log(64) / 20000) for i in range(20001)]
    for seed in range(5):
        g = torch.Generator().manual_seed(seed)
        knots = sorted(torch.rand(6, generator=g).tolist())

        def size(a, knots=knots):
            return 1000 - sum(100 for k in knots if math.log(a) > 8 * k - 4)

        cap = 1000 - 100 * int(torch.randint(1, 6, (1,), generator=g))
        got = fit_scale(size, cap, guess=guess)
        best = min(a for a in grid if size(a) <= cap)
        assert size(got) <= cap and abs(math.log(got) - math.log(best)) < 1e-3
    assert fit_scale(lambda a: 10, 5, guess=guess) is None
    assert fit_scale(lambda a: 10, 0, guess=guess) is None and fit_scale(lambda a: 10, -5, guess=guess) is None
    assert fit_scale(lambda a: 1, 5, guess=guess) == 1 / 64


def test_fit_from_a_guess_takes_fewer_sizes():
    """On power-law sizes that level off, with the staircase a float16 step gives them, a guess
    within a factor of two finds the search's answer (to its tolerance) in at most eight sizes,
    fewer in all than from the whole range, and sizes no scale twice."""
    n_guess = n_whole = 0
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        k = float(torch.rand(1, generator=g)) * 0.8 + 0.3
        c = float(torch.rand(1, generator=g)) * 1e7 + 1e6
        target = 0.25 + float(torch.rand(1, generator=g))

        def size(a, k=k, c=c):
            a16 = float(torch.tensor(a).half())  # the stored steps' float16 rounding: a staircase in alpha
            # bytes level off at coarse scales (headers, params, all-zero frames), so the log-log
            # curve bends over [1/64, 64] as real sizes do
            return int(c * (a16 ** -k + 0.2) * (1 + 0.002 * math.sin(40 * math.log(a16))))

        cap = float(size(target)) * (1 - 1e-4)
        calls = []

        def counted(a, size=size):
            calls.append(a)
            return size(a)

        whole = fit_scale(counted, cap)
        n_whole += len(calls)
        calls.clear()
        got = fit_scale(counted, cap, guess=target * (0.5 + float(torch.rand(1, generator=g)) * 1.5))
        n_guess += len(calls)
        assert size(got) <= cap and abs(math.log(got / whole)) <= 1e-3
        assert len(calls) == len(set(calls)) and len(calls) <= 8, calls
    assert n_guess < n_whole, (n_guess, n_whole)
