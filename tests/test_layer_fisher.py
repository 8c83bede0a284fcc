"""The Fisher estimate that splits ``ec``'s bytes across layers (``kdnctl.allocate.layer_fisher``):
the one-backward signed estimator against one backward per probe position (exactly, over every
sign pattern), the damage and multipliers against loops written here."""

from __future__ import annotations

import itertools
import math

import torch

from kdnctl.allocate import layer_fisher as lf


def _prefill(lm, n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 1000, (n,), generator=g).tolist()
    with torch.no_grad():
        pkv = lm.model(torch.tensor([ids]), use_cache=True).past_key_values
    return ids, [layer.keys[0].float() for layer in pkv.layers], [layer.values[0].float() for layer in pkv.layers]


def test_signed_estimator_averages_to_per_position_fisher(tiny_lm):
    ids, keys, values = _prefill(tiny_lm, 37)
    probe = ids[5:8]  # 3 positions: every sign pattern is 8 backwards
    weight = torch.rand(len(ids), generator=torch.Generator().manual_seed(1)) + 0.1
    y = torch.tensor([17, 400, 3])
    want = lf.naive_channel_fisher(tiny_lm, keys, values, probe, len(ids), weight, y)
    patterns = [torch.tensor(s, dtype=torch.float32) for s in itertools.product((-1.0, 1.0), repeat=len(probe))]
    runs = [lf.signed_fisher(tiny_lm, keys, values, probe, len(ids), weight, y, s) for s in patterns]
    for i, (fk, fv) in enumerate(want):
        mean_k = sum(r[i][0] for r in runs) / len(runs)
        mean_v = sum(r[i][1] for r in runs) / len(runs)
        assert fk.shape == keys[i][:, 0].shape and float(fk.sum()) > 0
        torch.testing.assert_close(mean_k, fk, rtol=1e-3, atol=1e-9)
        torch.testing.assert_close(mean_v, fv, rtol=1e-3, atol=1e-9)
    # one pattern alone is not the mean (the cross terms are there): the check can fail
    assert not torch.allclose(runs[1][0][0], want[0][0], rtol=1e-3)


def test_channel_fisher_is_seeded(tiny_lm):
    ids, keys, values = _prefill(tiny_lm, 29, seed=3)
    probe = lf.probe_ids(tiny_lm, ids, 2)
    w = torch.ones(len(ids))
    a = lf.channel_fisher(tiny_lm, keys, values, probe, len(ids), w, seed=4)
    b = lf.channel_fisher(tiny_lm, keys, values, probe, len(ids), w, seed=4)
    c = lf.channel_fisher(tiny_lm, keys, values, probe, len(ids), w, seed=5)
    assert all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))
    assert not all(torch.equal(x[0], y[0]) for x, y in zip(a, c))


def test_one_pass_fisher_equals_draws_then_backward(tiny_lm):
    """channel_fisher draws from the forward its backward runs through: bit for bit what a
    separate no-grad draw followed by signed_fisher gives (the stored steps depend on it)."""
    ids, keys, values = _prefill(tiny_lm, 41, seed=7)
    probe = lf.probe_ids(tiny_lm, ids, 2)
    w = torch.rand(len(ids), generator=torch.Generator().manual_seed(2)) + 0.1
    for seed in (0, 11):
        y, sign = lf._draws(tiny_lm, keys, values, probe, len(ids), seed)
        want = lf.signed_fisher(tiny_lm, keys, values, probe, len(ids), w, y, sign)
        got = lf.channel_fisher(tiny_lm, keys, values, probe, len(ids), w, seed=seed)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(want, got))


def test_fisher_takes_only_the_cache_gradients(tiny_lm):
    """The estimate differentiates with respect to the cache alone: bit for bit the cache
    gradients a full ``backward()`` gives, and no ``.grad`` left on the model's parameters (a
    second copy of the weights that ``backward()`` would keep for the life of the process)."""
    ids, keys, values = _prefill(tiny_lm, 33, seed=5)
    probe = lf.probe_ids(tiny_lm, ids, 2)
    w = torch.rand(len(ids), generator=torch.Generator().manual_seed(3)) + 0.1
    params = [p for p in tiny_lm.model.parameters() if p.requires_grad]
    assert params, "the test model must have parameters that take gradients, or the check below is empty"
    tiny_lm.model.zero_grad(set_to_none=True)
    got = lf.channel_fisher(tiny_lm, keys, values, probe, len(ids), w, seed=2)
    assert all(p.grad is None for p in params)
    y, sign = lf._draws(tiny_lm, keys, values, probe, len(ids), 2)
    ks = [k.detach().clone().requires_grad_(True) for k in keys]
    vs = [v.detach().clone().requires_grad_(True) for v in values]
    lp = lf._log_probs(tiny_lm, ks, vs, probe, len(ids))
    (lp.gather(1, y[:, None])[:, 0] * sign).sum().backward()
    assert any(p.grad is not None for p in params)  # what backward() leaves behind
    tiny_lm.model.zero_grad(set_to_none=True)
    ww = w[None, :, None]
    for (fk, fv), k, v in zip(got, ks, vs):
        assert torch.equal(fk, (k.grad.pow(2) * ww).sum(1)) and torch.equal(fv, (v.grad.pow(2) * ww).sum(1))


def test_damage_and_multipliers_match_loops():
    g = torch.Generator().manual_seed(0)
    fisher = [(torch.rand(3, 5, generator=g) * 10 ** i, torch.rand(3, 5, generator=g)) for i in range(-3, 3)]
    steps = [(torch.rand(3, 5, generator=g) + 0.1, torch.rand(3, 5, generator=g) + 0.1) for _ in fisher]
    damage = lf.layer_damage(fisher, steps)
    for i, (fs, ss) in enumerate(zip(fisher, steps)):
        for r in range(2):
            want = sum(0.5 * float(fs[r][h, c]) * float(ss[r][h, c]) ** 2 / 12 for h in range(3) for c in range(5))
            assert math.isclose(float(damage[i, r]), want, rel_tol=1e-5)
    mult = lf.layer_multipliers(damage)
    logs = [math.log(max(float(m), 1e-30)) for m in damage.flatten()]
    gmean = math.exp(sum(logs) / len(logs))
    for m, x in zip(damage.flatten().tolist(), mult.flatten().tolist()):
        want = min(max((gmean / max(m, 1e-30)) ** lf.EXPONENT, 1 / lf.CLIP), lf.CLIP)
        assert math.isclose(x, want, rel_tol=1e-5)
    assert float(mult.max()) == lf.CLIP and float(mult.min()) < 1  # the spread of 1e6 reaches the clip


def test_recipe_uses_the_fisher_split_at_every_budget_but_backfill():
    """Steps per layer and role come from the model's Fisher profile by default, also where tokens
    are evicted; backfill's coarse rows need even steps, so a backfill recipe defaults to even."""
    import pytest

    from kdnctl.compress.document import CompressRecipe
    from kdnctl.errors import UsageError

    full = CompressRecipe(budget=0.25)
    assert (full.quant, full.keep, full.layers) == ("ec", 1.0, "fisher")
    assert full.default_label() == "b0.25" and full.as_dict()["layers"] == "fisher"
    evicting = CompressRecipe(budget=0.083)
    assert evicting.keep < 1 and evicting.layers == "fisher" and evicting.as_dict()["layers"] == "fisher"
    assert evicting.default_label() == "b0.083"
    # the non-default split is spelled out in the label, so the two never share a version
    assert CompressRecipe(budget=0.083, layers="even").default_label() == "ec-b0.083-k0.5-p32-lliterals+sentences-gap0.3x2k-even-rf0.01hdf-sentences-gap"
    assert CompressRecipe(budget=0.25, quant="ec", protect=64, layers="even").default_label() == "ec-b0.25-p64-even"
    assert CompressRecipe(budget=0.25, quant="ec", keep=0.5, scorer="sentences").layers == "fisher"
    backfill = CompressRecipe(budget=0.083, quant="ec", keep=0.5, backfill="12-23")
    assert backfill.layers == "even" and "-even" not in backfill.default_label()
    with pytest.raises(UsageError, match="option backfill"):
        CompressRecipe(budget=0.083, quant="ec", keep=0.5, backfill="12-23", layers="fisher")
    with pytest.raises(UsageError, match="option layers must be"):
        CompressRecipe(budget=0.25, layers="uneven")
