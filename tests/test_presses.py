"""Presses on synthetic scores built so the right answer is known by hand."""

from __future__ import annotations

import math

import pytest
import torch

from kdnctl.errors import UnsupportedError, UsageError
from kdnctl.presses import (
    PRESSES,
    H2OPress,
    KNormPress,
    KVCrushPress,
    RandomPress,
    ScoreContext,
    SnapKVPress,
    StreamingPress,
    get_press,
    validate_budget,
)
from kdnctl.allocate import get_allocator
from kdnctl.allocate import allocate as allocate_quotas
from kdnctl.presses.base import select_top
from kdnctl.presses.document import chunk_quotas
from kdnctl.presses.document import select_document as select_with_quotas
from kdnctl.presses.kvcrush import representative_mask
from kdnctl.presses.snapkv import pool_scores


def select_document(press, ctx, budget, bounds, allocator="uniform"):
    """Document selection at ``budget`` with quotas split by ``allocator`` (as compress does)."""
    quotas = allocate_quotas(get_allocator(allocator), press, ctx, budget)
    return select_with_quotas(press, ctx, quotas, bounds)


def make_ctx(n_layers=2, n_heads=3, n_tokens=40, seed=0, **over):
    gen = torch.Generator().manual_seed(1234)
    shape = (n_layers, n_heads, n_tokens)
    ctx = dict(
        importance=torch.rand(shape, generator=gen),
        keys=[torch.randn(n_heads, n_tokens, 8, generator=gen) for _ in range(n_layers)],
        values=[torch.randn(n_heads, n_tokens, 8, generator=gen) for _ in range(n_layers)],
        stats={
            "window": torch.rand(shape, generator=gen),
            "accum": torch.rand(shape, generator=gen),
            "surprisal": torch.rand(n_tokens, generator=gen),
        },
        seed=seed,
    )
    ctx.update(over)
    return ScoreContext(**ctx)


def as_sets(kept):
    """per layer, per head: set of kept positions"""
    return [[set(row.tolist()) for row in layer] for layer in kept]


def expected_topk(scores_lh, k, forced):
    """plain-python reference: forced, then highest scores, ties to the earlier position"""
    rest = [t for t in range(len(scores_lh)) if t not in forced]
    rest.sort(key=lambda t: (-scores_lh[t], t))
    return set(forced) | set(rest[: k - len(forced)])


def check_shapes(kept, quotas, n_heads):
    for idx, k in zip(kept, quotas):
        assert idx.dtype == torch.int64 and idx.shape == (n_heads, k)
        if k > 1:
            assert bool((idx[:, 1:] > idx[:, :-1]).all()), "ascending, no duplicates"


# --------------------------------------------------------------------------- budgets


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), float("inf"), "abc", None, True])
def test_invalid_budget_raises_usage_error(bad):
    with pytest.raises(UsageError) as e:
        validate_budget(bad)
    assert e.value.hint
    with pytest.raises(UsageError):
        SnapKVPress().quotas_for_budget(bad, 100, 2)
    with pytest.raises(UsageError):
        select_document(StreamingPress(), make_ctx(), bad, [(0, 40)])


def test_quotas_for_budget_rounding_and_bounds():
    p = StreamingPress(sink_tokens=4)
    assert p.quotas_for_budget(0.25, 10, 3) == [4, 4, 4]  # 2.5 -> 3 (half up), then >= sinks
    assert StreamingPress(sink_tokens=0).quotas_for_budget(0.25, 10, 2) == [3, 3]
    assert StreamingPress(sink_tokens=0).quotas_for_budget(0.001, 10, 1) == [1]  # never 0
    assert p.quotas_for_budget(0.01, 100, 1) == [4]
    assert p.quotas_for_budget(1.0, 100, 2) == [100, 100]
    assert p.quotas_for_budget(0.5, 3, 1) == [3]  # sinks > T: capped at T
    assert p.quotas_for_budget(1.0, 1, 1) == [1]


def test_registry_and_options():
    assert set(PRESSES) == {"snapkv", "h2o", "streaming", "knorm", "random", "kvcrush", "spans", "shared"}
    with pytest.raises(UsageError) as e:
        get_press("nope")
    assert "snapkv" in e.value.hint and "kvcrush" in e.value.hint
    with pytest.raises(UsageError) as e:
        get_press("snapkv", kernal_size=3)
    assert "kernel_size" in e.value.hint
    assert get_press("SnapKV", kernel_size="5").kernel_size == 5  # CLI strings are coerced
    with pytest.raises(UsageError):
        get_press("snapkv", kernel_size="five")
    with pytest.raises(UsageError):
        get_press("snapkv", kernel_size=4)  # even windows would shift the scores
    with pytest.raises(UsageError):
        get_press("streaming", sink_tokens=-1)
    with pytest.raises(UsageError):
        get_press("kvcrush", anchor="median")
    with pytest.raises(UsageError):
        get_press("kvcrush", ratio=1.5)


def test_missing_statistics_are_unsupported():
    ctx = make_ctx(stats={}, keys=None)
    for name in ("snapkv", "h2o", "knorm"):
        p = get_press(name)
        with pytest.raises(UnsupportedError):
            p.select(ctx, p.quotas_for_budget(0.5, 40, 2))


# --------------------------------------------------------------------------- base rule


def test_forced_tokens_inside_quota_and_priority():
    p = StreamingPress(sink_tokens=4, recent_tokens=3)
    assert p.forced_indices(20, 10).tolist() == [0, 1, 2, 3, 19, 18, 17]
    assert p.forced_indices(20, 5).tolist() == [0, 1, 2, 3, 19]  # sinks win
    assert p.forced_indices(20, 2).tolist() == [0, 1]
    assert p.forced_indices(20, 10, keep_sinks=False).tolist() == [19, 18, 17]
    assert p.forced_indices(5, 10).tolist() == [0, 1, 2, 3, 4]  # overlap counted once


def test_nan_scores_never_win_and_ties_go_to_earlier_positions():
    s = torch.tensor([[float("nan"), 1.0, 1.0, 0.5, 1.0, float("nan")]])
    assert select_top(s, 2, torch.tensor([], dtype=torch.long)).tolist() == [[1, 2]]
    assert select_top(s, 5, torch.tensor([], dtype=torch.long)).tolist() == [[0, 1, 2, 3, 4]]


# --------------------------------------------------------------------------- per method


def test_snapkv_keeps_exact_topk_of_window_scores():
    ctx = make_ctx(n_layers=2, n_heads=3, n_tokens=40)
    p = SnapKVPress(kernel_size=1, sink_tokens=4)
    quotas = [12, 7]
    kept = p.select(ctx, quotas)
    check_shapes(kept, quotas, 3)
    w = ctx.stats["window"]
    for layer, k in enumerate(quotas):
        for h in range(3):
            assert set(kept[layer][h].tolist()) == expected_topk(w[layer, h].tolist(), k, [0, 1, 2, 3])


def test_snapkv_pooling_keeps_neighbourhood_of_a_spike():
    w = torch.zeros(1, 3, 30)
    w[0, 0, 10] = 1.0
    w[0, 1, 0] = 1.0  # spike at the edge: the window is clipped, not padded with fakes
    w[0, 2] = torch.linspace(0, 1, 30)
    ctx = make_ctx(n_layers=1, n_tokens=30, stats={"window": w})
    kept = SnapKVPress(kernel_size=7, sink_tokens=0).select(ctx, [7])
    assert kept[0][0].tolist() == list(range(7, 14))
    assert kept[0][1].tolist()[:4] == [0, 1, 2, 3]
    assert kept[0][2].tolist() == list(range(23, 30))
    avg = pool_scores(torch.tensor([[[3.0, 0.0, 0.0, 6.0]]]), 3, "avg")
    assert torch.allclose(avg, torch.tensor([[[1.5, 1.0, 2.0, 3.0]]]))  # edges / real count


def test_h2o_heavy_hitters_plus_recent():
    t = 30
    accum = torch.zeros(1, 2, t)
    accum[0, 0, [3, 7, 11, 15, 20]] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    accum[0, 1, [2, 4, 6, 8, 10, 12]] = 1.0
    ctx = make_ctx(n_layers=1, n_heads=2, n_tokens=t, stats={"accum": accum})
    kept = as_sets(H2OPress(sink_tokens=0, recent_ratio=0.5).select(ctx, [10]))
    recent = set(range(25, 30))  # round(0.5 * 10) = 5 recent tokens
    assert kept[0][0] == recent | {3, 7, 11, 15, 20}
    assert kept[0][1] == recent | {2, 4, 6, 8, 10}
    kept = as_sets(H2OPress(sink_tokens=0, recent_ratio=0.5, recent_tokens=8).select(ctx, [10]))
    assert kept[0][0] == set(range(22, 30)) | {3, 7}  # the larger fixed window wins


def test_streaming_sinks_plus_most_recent():
    ctx = make_ctx(n_layers=2, n_tokens=40)
    kept = StreamingPress(sink_tokens=4).select(ctx, [10, 4])
    check_shapes(kept, [10, 4], 3)
    assert kept[0].tolist() == [[0, 1, 2, 3] + list(range(34, 40))] * 3
    assert kept[1].tolist() == [[0, 1, 2, 3]] * 3
    no_sinks = StreamingPress(sink_tokens=4).select(ctx, [10, 4], keep_sinks=False)
    assert no_sinks[0].tolist() == [list(range(30, 40))] * 3


def test_knorm_keeps_lowest_key_norms():
    t, h = 20, 3
    perm = torch.randperm(t, generator=torch.Generator().manual_seed(0))
    keys = []
    for layer in range(2):
        k = torch.zeros(h, t, 8)
        for head in range(h):
            k[head, :, head] = (perm.roll(layer + head) + 1).float()  # norm = value
        keys.append(k)
    ctx = make_ctx(n_layers=2, n_heads=h, n_tokens=t, keys=keys)
    kept = as_sets(KNormPress(sink_tokens=0).select(ctx, [5, 5]))
    for layer in range(2):
        for head in range(h):
            norms = perm.roll(layer + head) + 1
            assert kept[layer][head] == set(torch.argsort(norms)[:5].tolist())


def test_random_is_seeded_and_chunking_invariant():
    ctx0, ctx0b, ctx1 = make_ctx(seed=0), make_ctx(seed=0), make_ctx(seed=1)
    p = RandomPress(sink_tokens=0)
    a, b, c = (p.select(x, [10, 10]) for x in (ctx0, ctx0b, ctx1))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))
    assert not torch.equal(a[0][0], a[0][1])  # heads differ
    assert torch.equal(p.score(ctx0.slice(13, 29)), p.score(ctx0)[..., 13:29])
    assert RandomPress(seed=5).score(ctx0).equal(RandomPress(seed=5).score(ctx1))


# --------------------------------------------------------------------------- KVCrush


def test_kvcrush_split():
    p = KVCrushPress(ratio=0.25)
    assert p.split(20, 4) == (15, 5)
    assert p.split(10, 4) == (7, 3)  # 2.5 rounds half up
    assert KVCrushPress(ratio=0.5).split(5, 4) == (4, 1)  # forced squeeze the representatives
    assert KVCrushPress(ratio=0.0).split(9, 0) == (9, 0)


def test_kvcrush_ratio_zero_is_plain_importance_topk():
    ctx = make_ctx()
    a = KVCrushPress(ratio=0.0).select(ctx, [11, 6])
    b = SnapKVPress(kernel_size=1).select(make_ctx(stats={"window": ctx.importance}), [11, 6])
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_representatives_evenly_spaced_over_sorted_distances():
    dist = torch.tensor([3, 0, 1, 2, 0, 1, 3, 2, 1, 0, 2, 3])
    # stable sort: [1,4,9, 2,5,8, 3,7,10, 0,6,11]; 1 and 6 are kept by every head, so the
    # candidates are C = [4,9,2,5,8,3,7,10,0,11] and the 3 bucket centres are C[1], C[5], C[8]
    kept = torch.zeros(3, 12, dtype=torch.bool)
    kept[0, [1, 6, 5, 8]] = True  # centres all free -> 9, 3, 0
    kept[1, [1, 6, 3, 7]] = True  # C[5]=3 and C[6]=7 kept -> next free C[7]=10
    kept[2, [1, 6, 0, 11]] = True  # C[8]=0 and C[9]=11 kept -> wraps to C[0]=4
    reps = representative_mask(dist, kept, 3)
    assert [set(torch.nonzero(r).flatten().tolist()) for r in reps] == [{9, 3, 0}, {9, 10, 0}, {9, 3, 4}]
    assert not bool((reps & kept).any())


def kvcrush_hand_ctx(n_layers=2):
    imp = torch.arange(16.0).expand(n_layers, 1, 16).contiguous()
    return make_ctx(n_layers=n_layers, n_heads=1, n_tokens=16, importance=imp)


@pytest.mark.parametrize("anchor", ["alternate", "mean"])
def test_kvcrush_end_to_end_hand_case_heads(anchor):
    # importance 0..15, one head: bit = score > median(=7) -> tokens 8..15 have bit 1; the
    # anchor is [1] (alternate "1", and "mean": half the tokens have the bit -> 1), so the
    # distance is 0 for 8..15 and 1 for 0..7. k=8, ratio 0.5: importance keeps 12..15; the
    # candidates in distance order are [8,9,10,11,0,...,7] (M=12) and the centres of 4
    # buckets are positions 1,4,7,10 -> tokens 9, 0, 3, 6.
    kept = KVCrushPress(ratio=0.5, anchor=anchor, sink_tokens=0).select(kvcrush_hand_ctx(), [8, 8])
    assert kept[0].tolist() == [[0, 3, 6, 9, 12, 13, 14, 15]]
    assert kept[1].tolist() == kept[0].tolist()


def test_kvcrush_end_to_end_hand_case_layers_bits():
    # bits="layers": 2 layers x 1 head -> vector [b, b]; anchor "alternate" = [1, 0], so every
    # token is at distance 1 and the order is by position: candidates 0..11, centres 1,4,7,10.
    kept = KVCrushPress(ratio=0.5, anchor="alternate", bits="layers", sink_tokens=0).select(
        kvcrush_hand_ctx(), [8, 8]
    )
    assert kept[0].tolist() == [[1, 4, 7, 10, 12, 13, 14, 15]]


def test_kvcrush_pages_fill_partial_page_by_token_score():
    imp = torch.tensor([[[9.0, 8, 9, 8, 0, 0, 0, 0, 1, 5, 3, 4]]])  # pages of 4: means 8.5, 0, 3.25
    ctx = make_ctx(n_layers=1, n_heads=1, n_tokens=12, importance=imp)
    kept = KVCrushPress(ratio=0.0, page_size=4, sink_tokens=0).select(ctx, [6])
    assert kept[0].tolist() == [[0, 1, 2, 3, 9, 11]]  # page 0 whole, best 2 of page 2
    kept = KVCrushPress(ratio=0.0, page_size=4, sink_tokens=0).select(ctx, [8])
    assert kept[0].tolist() == [[0, 1, 2, 3, 8, 9, 10, 11]]


def test_kvcrush_anchors_seeded():
    vectors = torch.zeros(1, 5, 90, dtype=torch.uint8)
    p = KVCrushPress(anchor="random", bits="layers")
    assert torch.equal(p.anchor_bits(vectors, 0), p.anchor_bits(vectors, 0))
    assert not torch.equal(p.anchor_bits(vectors, 0), p.anchor_bits(vectors, 1))
    alt = KVCrushPress(anchor="alternate").anchor_bits(vectors[..., :5], 0)
    assert alt.tolist() == [[1, 0, 1, 0, 1]]
    ctx = make_ctx(n_layers=30, n_heads=3, n_tokens=64)
    a = p.select(ctx, [16] * 30)
    assert all(torch.equal(x, y) for x, y in zip(a, p.select(ctx, [16] * 30)))
    b = p.select(make_ctx(n_layers=30, n_heads=3, n_tokens=64, seed=7), [16] * 30)
    assert not all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize(
    "opts",
    [{}, {"bits": "layers"}, {"page_size": 5, "anchor": "mean"}, {"ratio": 0.9, "anchor": "alternate"}],
)
def test_kvcrush_exact_quota_every_head(opts):
    ctx = make_ctx(n_layers=4, n_heads=3, n_tokens=97)
    p = KVCrushPress(sink_tokens=4, recent_tokens=2, **opts)
    quotas = [1, 6, 40, 97]
    kept = p.select(ctx, quotas)
    check_shapes(kept, quotas, 3)
    for idx in kept[1:]:
        assert {0, 1, 2, 3, 96} <= set(idx[0].tolist())


# --------------------------------------------------------------------------- allocation


def test_chunk_quotas_largest_remainder():
    kept = [torch.tensor([[0, 1, 2, 3], [0, 1, 5, 6], [0, 5, 6, 7]])]
    # counts per chunk: c0 = 4+2+1 = 7, c1 = 0+2+3 = 5 -> 7/3, 5/3 -> floors 2, 1; the extra
    # token goes to the larger remainder (c1)
    assert chunk_quotas(kept, [(0, 5), (5, 10)]) == [[2], [2]]


@pytest.mark.parametrize("name,allocator", [(n, "uniform") for n in sorted(PRESSES)]
                         + [("snapkv", "pyramid"), ("kvcrush", "pyramid"), ("kvcrush", "adaptive")])
def test_select_document_equal_heads_and_layer_sums(name, allocator):
    ctx = make_ctx(n_layers=5, n_heads=3, n_tokens=90)
    press = get_press(name, recent_tokens=3) if name != "h2o" else get_press(name)
    bounds = [(0, 32), (32, 64), (64, 90)]
    res = select_document(press, ctx, 0.3, bounds, allocator)
    quotas = allocate_quotas(get_allocator(allocator), press, ctx, 0.3)
    for layer in range(5):
        assert sum(res[c][layer].shape[1] for c in range(3)) == quotas[layer]
    for c, (s, e) in enumerate(bounds):
        check_shapes(res[c], [x.shape[1] for x in res[c]], 3)
        for idx in res[c]:
            assert idx.numel() == 0 or (int(idx.min()) >= 0 and int(idx.max()) < e - s)
    again = select_document(press, ctx, 0.3, bounds, allocator)
    assert all(torch.equal(a, b) for ra, rb in zip(res, again) for a, b in zip(ra, rb))


def test_select_document_sinks_first_chunk_recent_last_chunk():
    ctx = make_ctx(n_layers=1, n_heads=3, n_tokens=30)
    res = select_document(StreamingPress(sink_tokens=4), ctx, 0.5, [(0, 10), (10, 20), (20, 30)])
    # document: 15 tokens = sinks 0..3 + 19..29 -> chunk quotas 4, 1, 10
    assert [r[0].tolist() for r in res] == [[[0, 1, 2, 3]] * 3, [[9]] * 3, [list(range(10))] * 3]
    accum = torch.zeros(1, 3, 30)
    accum[0, :, [2, 12, 13, 22]] = 1.0
    ctx = make_ctx(n_layers=1, n_heads=3, n_tokens=30, stats={"accum": accum})
    p = H2OPress(sink_tokens=1, recent_tokens=3, recent_ratio=0.0)
    res = select_document(p, ctx, 0.3, [(0, 10), (10, 20), (20, 30)])
    # document: 9 = sink 0 + recent 27..29 + heavy 2, 12, 13, 22 + 1 tie (earliest: 1), so
    # chunk quotas 3, 2, 4; the middle chunk keeps no recent tokens, the first no more sinks
    assert [r[0][0].tolist() for r in res] == [[0, 1, 2], [2, 3], [2, 7, 8, 9]]


def test_select_document_rejects_bad_chunk_bounds():
    ctx = make_ctx(n_tokens=40)
    for bounds in ([(0, 20), (21, 40)], [(0, 20)], [], [(0, 0), (0, 40)]):
        with pytest.raises(UsageError):
            select_document(StreamingPress(), ctx, 0.5, bounds)
    assert math.isclose(validate_budget("0.5"), 0.5)


def test_spans_keep_whole_top_spans_identically_in_every_head():
    # 2 layers, 3 heads, 20 tokens, spans of 4: spans 1 and 3 are the most important on average,
    # span 4 next, even though single heads disagree about individual tokens
    imp = torch.zeros(2, 3, 20)
    span_rank = {0: 0.1, 1: 0.9, 2: 0.2, 3: 0.8, 4: 0.5}
    gen = torch.Generator().manual_seed(7)
    for t in range(20):
        imp[..., t] = span_rank[t // 4] + 0.05 * torch.rand(2, 3, generator=gen)
    ctx = make_ctx(n_layers=2, n_heads=3, n_tokens=20, importance=imp)
    press = get_press("spans", span_tokens=4, sink_tokens=0)
    kept = press.select(ctx, [8, 8])
    for layer in kept:
        assert layer.tolist() == [[4, 5, 6, 7, 12, 13, 14, 15]] * 3
    # a quota that splits a span fills it from its earliest tokens, still the same in every head
    kept = press.select(ctx, [10, 10])
    assert all(layer.tolist() == [[4, 5, 6, 7, 12, 13, 14, 15, 16, 17]] * 3 for layer in kept)
    # sinks are forced inside the quota
    kept = get_press("spans", span_tokens=4, sink_tokens=2).select(ctx, [8, 8])
    assert kept[0][0].tolist() == [0, 1, 4, 5, 6, 7, 12, 13]
    with pytest.raises(UsageError):
        get_press("spans", span_tokens=0)


def test_spans_through_chunked_document_keep_spans_whole():
    imp = torch.rand(3, 3, 64, generator=torch.Generator().manual_seed(3))
    ctx = make_ctx(n_layers=3, n_heads=3, n_tokens=64, importance=imp)
    press = get_press("spans", span_tokens=8, sink_tokens=0)
    picks = select_document(press, ctx, 0.25, [(0, 32), (32, 64)])
    total = 0
    for c, chunk in enumerate(picks):
        for layer in chunk:
            assert all(row.tolist() == layer[0].tolist() for row in layer)  # same in every head
            pos = [p + 32 * c for p in layer[0].tolist()]
            # quota 16 of 64 at span 8: whole spans only (2 of them, in some chunk split)
            assert len(pos) % 8 == 0 and all(p % 8 == 0 for p in pos[::8]) and all(
                pos[i + 1] == pos[i] + 1 for i in range(len(pos) - 1) if (i + 1) % 8)
        total += chunk[0].shape[1]
    assert total == 16


def test_shared_keeps_one_set_everywhere_and_always_the_last_token():
    # the last token is the worst in every head: still kept (llama.cpp's next batch must start
    # at the largest cached position + 1), identically in every layer and head, in every chunking
    imp = torch.rand(3, 3, 64, generator=torch.Generator().manual_seed(5))
    imp[..., -1] = -1.0
    ctx = make_ctx(n_layers=3, n_heads=3, n_tokens=64, importance=imp)
    press = get_press("shared", sink_tokens=2)  # wraps kvcrush, which ranks by importance
    for bounds in ([(0, 64)], [(0, 20), (20, 45), (45, 64)]):
        picks = select_document(press, ctx, 0.25, bounds)
        doc = sorted(p + bounds[c][0] for c, chunk in enumerate(picks) for p in chunk[0][0].tolist())
        assert len(doc) == 16 and doc[:2] == [0, 1] and doc[-1] == 63
        for c, chunk in enumerate(picks):
            assert all(row.tolist() == chunk[0][0].tolist() for layer in chunk for row in layer)
    # a quota of one keeps the tail before the sinks; without keep_recent (a middle chunk) no tail
    assert press.forced_indices(10, 1).tolist() == [9]
    assert press.forced_indices(10, 5, keep_recent=False).tolist() == [0, 1]
    assert get_press("knorm", sink_tokens=2).forced_indices(10, 5).tolist() == [0, 1]
