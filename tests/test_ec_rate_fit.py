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
