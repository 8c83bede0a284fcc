"""Allocators: how a budget is split over layers, on synthetic inputs with known answers."""

from __future__ import annotations

import pytest
import torch

from kdnctl.allocate import ALLOCATORS, allocate, get_allocator
from kdnctl.allocate.pyramid import pyramid_quotas
from kdnctl.compress.document import CompressRecipe
from kdnctl.errors import UnsupportedError, UsageError
from kdnctl.presses import KVCrushPress, SnapKVPress, get_press
from kdnctl.presses.document import select_document
from test_presses import check_shapes, make_ctx


def test_registry_and_options():
    assert set(ALLOCATORS) == {"uniform", "pyramid", "adaptive"}
    with pytest.raises(UsageError) as e:
        get_allocator("nope")
    assert "pyramid" in e.value.hint and "adaptive" in e.value.hint
    with pytest.raises(UsageError) as e:
        get_allocator("pyramid", bta=3)
    assert "beta" in e.value.hint
    assert get_allocator("pyramid", beta="10").beta == 10.0  # strings from the command line


def test_uniform_is_the_press_quota():
    ctx = make_ctx(n_layers=4, n_tokens=50)
    press = SnapKVPress(sink_tokens=4)
    assert allocate(get_allocator("uniform"), press, ctx, 0.3) == press.quotas_for_budget(0.3, 50, 4) == [15] * 4


@pytest.mark.parametrize(
    "n_tokens,budget",
    [(512, 0.1), (512, 0.5), (100, 0.08), (100, 0.05), (100, 0.03), (2000, 0.25), (64, 0.9)],
)
def test_pyramid_total_and_shape(n_tokens, budget):
    ctx = make_ctx(n_layers=30, n_heads=1, n_tokens=n_tokens)
    press = SnapKVPress(sink_tokens=4)
    uniform = press.quotas_for_budget(budget, n_tokens, 30)
    q = allocate(get_allocator("pyramid"), press, ctx, budget)
    assert sum(q) == sum(uniform)
    assert all(a >= b for a, b in zip(q, q[1:])), "non-increasing with depth"
    if sum(uniform) < 30 * 5:  # below sinks+1 per layer: stays uniform (at the sinks floor)
        assert q == uniform
        return
    assert all(5 <= x <= n_tokens for x in q)
    if sum(uniform) > 30 * 5 and budget < 0.9:
        assert q[0] > q[-1]


def test_pyramid_linear_and_options():
    q = pyramid_quotas(total=60 * 10, n_layers=10, lo=1, hi=1000, beta=3.0)
    # avg 60, beta 3: top 20, bottom 100, step 80/9; fractions rounded by largest remainder
    assert q == [100, 91, 82, 73, 64, 56, 47, 38, 29, 20]
    assert pyramid_quotas(100, 4, 30, 50, 20.0) is None  # 4*30 > 100: infeasible
    flat = allocate(get_allocator("pyramid", beta=1.0), SnapKVPress(), make_ctx(n_layers=5, n_tokens=100), 0.5)
    assert flat == [50] * 5
    ctx = make_ctx(n_layers=6, n_tokens=80)
    press = get_press("kvcrush", ratio="0.3")
    q = allocate(get_allocator("pyramid", beta=10), press, ctx, 0.2)
    assert q[0] > q[-1] and sum(q) == 6 * 16
    check_shapes(press.select(ctx, q), q, 3)
    with pytest.raises(UsageError):
        get_allocator("pyramid", beta=0.5)


def test_adaptive_quotas_follow_attention_concentration():
    # layer 0 spreads its attention evenly, layer 1 puts it all on 2 tokens: layer 0 gets more
    t = 40
    accum = torch.zeros(2, 3, t)
    accum[0] = 1.0
    accum[1, :, 5] = 10.0
    accum[1, :, 9] = 5.0
    ctx = make_ctx(n_layers=2, n_heads=3, n_tokens=t, stats={"accum": accum})
    press = KVCrushPress(sink_tokens=0)
    adaptive = get_allocator("adaptive", floor=0.25)
    quotas = allocate(adaptive, press, ctx, 0.25)
    assert sum(quotas) == 2 * 10 and quotas[0] > quotas[1] >= 2  # floor 0.25 * 10 rounds to 3
    assert quotas == [17, 3]
    kept = select_document(press, ctx, quotas, [(0, 20), (20, 40)])
    assert [sum(c[layer].shape[1] for c in kept) for layer in range(2)] == quotas
    # uniform attention everywhere: the allocation stays (almost) uniform and exact
    ctx_u = make_ctx(n_layers=3, n_heads=3, n_tokens=t, stats={"accum": torch.ones(3, 3, t)})
    q = allocate(get_allocator("adaptive"), KVCrushPress(sink_tokens=0), ctx_u, 0.25)
    assert sum(q) == 30 and max(q) - min(q) <= 1
    with pytest.raises(UsageError):
        get_allocator("adaptive", floor=2.0)
    with pytest.raises(UnsupportedError):  # no accumulated-attention statistic recorded
        allocate(get_allocator("adaptive"), KVCrushPress(), make_ctx(stats={}), 0.25)


def test_recipe_field_and_legacy_spellings():
    """``allocator`` is a recipe field; the old ``pyramid[:METHOD]`` press spellings map onto it."""
    r = CompressRecipe(budget=None, keep=0.25, method="kvcrush", allocator="pyramid", allocator_options={"beta": 5})
    assert r.as_dict()["allocator"] == "pyramid" and r.default_label() == "pyramid-kvcrush-k0.25"
    assert "allocator" not in CompressRecipe().as_dict()  # uniform: the step of older versions
    for spelling, opts, method, press_opts, alloc_opts in [
        ("pyramid", {}, "snapkv", {}, {}),
        ("pyramid:kvcrush", {"ratio": 0.3}, "kvcrush", {"ratio": 0.3}, {}),
        ("pyramid", {"press": "kvcrush", "beta": 10, "press_options": {"ratio": 0.3}}, "kvcrush", {"ratio": 0.3}, {"beta": 10}),
        ("adaptive", {"floor": 0.5}, "kvcrush", {}, {"floor": 0.5}),
    ]:
        legacy = CompressRecipe(method=spelling, method_options=opts)
        assert (legacy.method, legacy.method_options, legacy.allocator_options) == (method, press_opts, alloc_opts)
        assert legacy.allocator == spelling.split(":")[0]
