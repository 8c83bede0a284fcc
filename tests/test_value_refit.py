"""Value refit (kdnctl/compress/refit.py, ``--refit``): the kept tokens' values are refitted so that
attention over the kept keys reproduces the full cache's output for the document's own queries.
The fast solve equals the normal equations summed query by query (in both of its spaces),
keeping every token changes nothing, the fit shrinks the error eviction leaves, and the recipe
and a real compress with the tiny model carry it."""

from __future__ import annotations

import pytest
import torch

from kdnctl.errors import UsageError
from kdnctl.compress.refit import naive_refit_values, refit_values

TOL = {"rtol": 1e-3, "atol": 1e-4}  # float32 solve against the float64 reference


def _case(h, group, n, t, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(h * group, n, d, generator=g)
    k = torch.randn(h, t, d, generator=g)
    v = torch.randn(h, t, d, generator=g)
    return q, k, v


@pytest.mark.parametrize("n,t,s", [(7, 37, 11), (29, 41, 13)])  # kept tokens fewer and more than the queries
@pytest.mark.parametrize("rho", [0.01, 1.0])
def test_refit_equals_the_naive_normal_equations(n, t, s, rho):
    q, k, v = _case(3, 3, n, t, 17, seed=n + t)
    kept = torch.randperm(t, generator=torch.Generator().manual_seed(s))[:s].sort().values
    fast = refit_values(q, k, v, kept, 17 ** -0.5, rho)
    ref = naive_refit_values(q, k, v, kept, 17 ** -0.5, rho)
    assert fast.shape == (3, s, 17)
    torch.testing.assert_close(fast, ref, **TOL)


@pytest.mark.parametrize("n,t,s", [(7, 37, 11), (29, 41, 13)])
def test_held_tokens_keep_their_values_and_the_rest_equals_the_naive_solve(n, t, s):
    q, k, v = _case(3, 3, n, t, 17, seed=2 * n + t)
    kept = torch.randperm(t, generator=torch.Generator().manual_seed(s))[:s].sort().values
    hold = torch.zeros(s, dtype=torch.bool)
    hold[torch.randperm(s, generator=torch.Generator().manual_seed(n))[: s // 3]] = True
    fast = refit_values(q, k, v, kept, 17 ** -0.5, 0.01, hold)
    torch.testing.assert_close(fast, naive_refit_values(q, k, v, kept, 17 ** -0.5, 0.01, hold), **TOL)
    assert torch.equal(fast[:, hold], v[:, kept][:, hold].float())
    assert not torch.allclose(fast, refit_values(q, k, v, kept, 17 ** -0.5, 0.01), **TOL)  # the free ones absorb more
    every = refit_values(q, k, v, kept, 17 ** -0.5, 0.01, torch.ones(s, dtype=torch.bool))
    assert torch.equal(every, v[:, kept].float())


@pytest.mark.parametrize("n,t,s", [(7, 37, 11), (29, 41, 13)])
@pytest.mark.parametrize("held", [False, True])
def test_a_fit_to_the_keys_the_tokens_are_read_with_equals_the_naive_solve(n, t, s, held):
    """``kept_keys`` (``--refit-decoded``: the keys as decoded) replace the kept keys in the fit,
    not in the target; the kept keys themselves give the plain fit back."""
    q, k, v = _case(3, 3, n, t, 17, seed=3 * n + t)
    kept = torch.randperm(t, generator=torch.Generator().manual_seed(s))[:s].sort().values
    hold = None
    if held:
        hold = torch.zeros(s, dtype=torch.bool)
        hold[: s // 3] = True
    noisy = k[:, kept] + 0.3 * torch.randn(3, s, 17, generator=torch.Generator().manual_seed(t))
    fast = refit_values(q, k, v, kept, 17 ** -0.5, 0.01, hold, noisy)
    torch.testing.assert_close(fast, naive_refit_values(q, k, v, kept, 17 ** -0.5, 0.01, hold, noisy), **TOL)
    plain = refit_values(q, k, v, kept, 17 ** -0.5, 0.01, hold)
    assert not torch.allclose(fast, plain, **TOL)
    torch.testing.assert_close(refit_values(q, k, v, kept, 17 ** -0.5, 0.01, hold, k[:, kept]), plain)


@pytest.mark.parametrize("n,t,s", [(7, 37, 11), (29, 41, 13)])  # both spaces of the solve
def test_the_blocked_cholesky_solve_equals_the_naive_normal_equations(n, t, s, monkeypatch):
    """Systems of ``SPD_MIN`` unknowns and more take the Gram's lower blocks and a Cholesky solve:
    with the thresholds lowered to these sizes (blocks of 4: a last block narrower than the
    others) the refit still equals the normal equations summed query by query."""
    import kdnctl.compress.refit as rf

    q, k, v = _case(3, 3, n, t, 17, seed=5 * n + t)
    kept = torch.randperm(t, generator=torch.Generator().manual_seed(s))[:s].sort().values
    hold = torch.zeros(s, dtype=torch.bool)
    hold[: s // 4] = True
    small = refit_values(q, k, v, kept, 17 ** -0.5, 0.01, hold)
    monkeypatch.setattr(rf, "SPD_MIN", 5)
    monkeypatch.setattr(rf, "SPD_BLOCK", 4)
    blocked = refit_values(q, k, v, kept, 17 ** -0.5, 0.01, hold)
    torch.testing.assert_close(blocked, naive_refit_values(q, k, v, kept, 17 ** -0.5, 0.01, hold), **TOL)
    assert not torch.equal(blocked, small)  # (the other path ran: its sums round otherwise)
    torch.testing.assert_close(blocked, small, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("s", [5, 9, 12])
def test_ridge_solve_reads_every_block_and_falls_back_where_cholesky_fails(s, monkeypatch):
    """The blocked Gram fills every block of the lower triangle (against the float64 system,
    blocks of 4: ragged where ``s`` is not a multiple); a matrix rounding or a negative weight
    leaves indefinite goes to the LU solve of the whole matrix."""
    import kdnctl.compress.refit as rf

    monkeypatch.setattr(rf, "SPD_MIN", 5)
    monkeypatch.setattr(rf, "SPD_BLOCK", 4)
    g = torch.Generator().manual_seed(s)
    m, rhs = torch.randn(3 * s, s, generator=g), torch.randn(s, 6, generator=g)
    for lam in (0.5, -2.0 * float(torch.linalg.eigvalsh((m.T @ m).double())[0]) - 1.0):  # PD, then indefinite
        want = torch.linalg.solve(m.double().T @ m.double() + lam * torch.eye(s, dtype=torch.float64), rhs.double())
        torch.testing.assert_close(rf.ridge_solve(m, lam, rhs).double(), want, rtol=1e-3, atol=1e-4)
    assert int(torch.linalg.cholesky_ex(m.T @ m + lam * torch.eye(s))[1]) != 0  # (the second did fall back)


def _overfit_case(seed, n=6):
    """One KV head, two query heads: ``n`` fitted queries per head against 40 kept tokens (more
    free values than queries, a light ridge), and 30 held-out queries per head."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, n, 8, generator=g) * 2
    k, v = torch.randn(1, 60, 8, generator=g), torch.randn(1, 60, 8, generator=g)
    check = torch.randn(2, 30, 8, generator=g) * 2
    kept = torch.randperm(60, generator=g)[:40].sort().values
    return q, k, v, check, kept


def _check_error(check, k, v, kept, x, scale) -> float:
    qc = check.reshape(-1, check.shape[-1])
    full = torch.softmax(qc @ k[0].T * scale, -1) @ v[0]
    return float((torch.softmax(qc @ k[0, kept].T * scale, -1) @ x[0] - full).pow(2).sum())


# cases whose fit leaves the held-out queries worse off, and which of the two serves them better
@pytest.mark.parametrize("n,seed,best", [(6, 0, "plain"), (6, 9, "plain"), (16, 10, "heavier"), (20, 17, "heavier")])
def test_a_fit_that_leaves_held_out_queries_worse_off_is_redone_heavier_or_dropped(n, seed, best):
    """With held-out queries (``check``) a head whose fit serves them worse than the kept values
    as they are takes the better of the fit at ``RIDGE_RETRY`` times the weight and no fit."""
    import kdnctl.compress.refit as rf

    q, k, v, check, kept = _overfit_case(seed, n)
    scale = 8 ** -0.5
    plain, fit = v[:, kept].float(), refit_values(q, k, v, kept, scale, 1e-4)
    assert _check_error(check, k, v, kept, fit, scale) > _check_error(check, k, v, kept, plain, scale)
    got = refit_values(q, k, v, kept, scale, 1e-4, check=check)
    heavier = refit_values(q, k, v, kept, scale, 1e-4 * rf.RIDGE_RETRY)
    errors = {name: _check_error(check, k, v, kept, x, scale) for name, x in (("heavier", heavier), ("plain", plain))}
    assert min(errors, key=errors.get) == best
    assert torch.equal(got, heavier if best == "heavier" else plain)


@pytest.mark.parametrize("seed", [3, 5, 10])  # seeds whose fit serves the held-out queries better
def test_a_fit_that_serves_held_out_queries_better_stands(seed):
    q, k, v, check, kept = _overfit_case(seed)
    scale = 8 ** -0.5
    fit = refit_values(q, k, v, kept, scale, 1e-4)
    assert _check_error(check, k, v, kept, fit, scale) < _check_error(check, k, v, kept, v[:, kept].float(), scale)
    assert torch.equal(refit_values(q, k, v, kept, scale, 1e-4, check=check), fit)


def test_keeping_every_token_changes_nothing():
    q, k, v = _case(2, 3, 9, 23, 8, seed=3)
    out = refit_values(q, k, v, torch.arange(23), 8 ** -0.5, 0.1)
    torch.testing.assert_close(out, v, **TOL)


def test_the_fit_shrinks_the_attention_error_eviction_leaves():
    q, k, v = _case(3, 3, 64, 90, 16, seed=5)
    kept = torch.arange(0, 90, 3)
    scale = 16 ** -0.5

    def err(vals):
        total = 0.0
        for h in range(3):
            qh = q[h * 3:(h + 1) * 3].reshape(-1, 16)
            full = torch.softmax(qh @ k[h].T * scale, -1) @ v[h]
            total += float((torch.softmax(qh @ k[h, kept].T * scale, -1) @ vals[h] - full).pow(2).sum())
        return total

    plain = err(v[:, kept])
    assert err(refit_values(q, k, v, kept, scale, 0.01)) < 0.5 * plain
    # a heavier ridge stays nearer the kept values: less of the error is removed
    assert err(refit_values(q, k, v, kept, scale, 0.01)) < err(refit_values(q, k, v, kept, scale, 10.0)) < plain


def test_recipe_refit_is_asked_for_recorded_and_labelled():
    from kdnctl.compress.document import CompressRecipe

    # the default below 0.25: ridge 0.01, the lifted tokens' values held, fitted to the keys as
    # decoded and rounded with feedback
    auto = CompressRecipe(budget=0.083)
    assert (auto.refit, auto.refit_hold, auto.refit_decoded, auto.refit_feedback) == (0.01, True, True, True)
    assert {k: auto.as_dict()[k] for k in ("refit", "refit_hold", "refit_decoded", "refit_feedback")} == \
        {"refit": 0.01, "refit_hold": True, "refit_decoded": True, "refit_feedback": True}
    # the refit alone, held, not fitted to the decoded keys: named by its steps
    held_only = CompressRecipe(budget=0.083, refit=0.01, refit_hold=True)
    assert not (held_only.refit_decoded or held_only.refit_feedback)
    assert held_only.default_label() == "ec-b0.083-k0.5-p32-lliterals+sentences-gap0.3x2k-rf0.01h-sentences-gap"
    assert auto.default_label() == "b0.083"
    on = CompressRecipe(budget=0.083, refit=0.01)  # a user's --refit stands as given: no hold
    assert on.refit == 0.01 and on.as_dict()["refit"] == 0.01 and "refit_hold" not in on.as_dict()
    assert on.default_label() == "ec-b0.083-k0.5-p32-lliterals+sentences-gap0.3x2k-rf0.01-sentences-gap"
    off = CompressRecipe(budget=0.083, refit=0)
    assert off.refit is None and not (off.refit_hold or off.refit_decoded or off.refit_feedback) and "refit" not in off.as_dict()
    assert off.default_label() == "ec-b0.083-k0.5-p32-lliterals+sentences-gap0.3x2k-sentences-gap"
    # no lift (nothing to hold), a backfill, every token kept or a spelled-out recipe: no auto refit
    assert CompressRecipe(budget=0.083, lift="none").refit is None
    assert CompressRecipe(budget=0.083, backfill="12-23").refit is None
    assert CompressRecipe(budget=0.25).refit is None
    assert CompressRecipe(budget=0.083, quant="ec", keep=0.5, protect=32, scorer="sentences-gap").refit is None
    assert CompressRecipe(budget=0.083, refit_hold=True).default_label() == auto.default_label()
    with pytest.raises(UsageError, match="option refit"):  # every token kept: nothing to refit
        CompressRecipe(budget=0.25, quant="ec", refit=0.1)
    with pytest.raises(UsageError, match="option refit"):
        CompressRecipe(budget=0.083, backfill="12-23", refit=0.1)
    with pytest.raises(UsageError, match="ridge weight"):
        CompressRecipe(budget=0.083, refit=-1)
    held = CompressRecipe(budget=0.083, refit=0.01, refit_hold=True)
    assert held.as_dict()["refit_hold"] is True and "refit_hold" not in on.as_dict()
    assert held.default_label() == on.default_label().replace("-rf0.01-", "-rf0.01h-")
    with pytest.raises(UsageError, match="option refit_hold"):  # nothing to hold the values out of
        CompressRecipe(budget=0.083, refit=0, refit_hold=True)
    with pytest.raises(UsageError, match="option refit_hold"):  # no lift: no tokens to hold
        CompressRecipe(budget=0.083, refit=0.01, refit_hold=True, lift="none")


def test_compress_with_refit_end_to_end(tiny_lm, tmp_path_factory):
    """The tiny model: a refitted version fits its cap, keeps the same tokens and keys as the
    version without refit, stores other values, and those values read the full cache's
    attention output more closely (the library's own queries, layer by layer)."""
    from budgetkit import fp16_size, layers_read_nearer, trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.engine.hf import load_document

    st = trimmed_store(tmp_path_factory, tiny_lm, {"faq.md": 300})
    with st.writer():
        on = compress_document(st, "faq.md", CompressRecipe(budget=0.3, quant="ec", keep=0.5, protect=16,
                                                            scorer="sentences", refit=0.01), lm=tiny_lm)
        off = compress_document(st, "faq.md", CompressRecipe(budget=0.3, quant="ec", keep=0.5, protect=16,
                                                             scorer="sentences"), lm=tiny_lm)
        full = load_document(tiny_lm, st, "faq.md", "full")
    assert on.label.endswith("-rf0.01-sentences") and on.bytes <= 0.3 * fp16_size(st, "faq.md")
    a, b = load_document(tiny_lm, st, "faq.md", on.label), load_document(tiny_lm, st, "faq.md", off.label)
    assert a.keys[0].shape == b.keys[0].shape and a.keys[0].shape[2] < full.keys[0].shape[2]
    assert not torch.allclose(a.values[-1], b.values[-1])
    assert layers_read_nearer(tiny_lm, full, a, b) >= 0.8 * len(full.keys)


def test_compress_with_held_refit_end_to_end(tiny_lm, tmp_path_factory):
    """``--refit-hold`` through a real compress: the label says so, the cap holds, and the stored
    values are neither the refit's nor the plain kept set's."""
    from budgetkit import fp16_size, trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.engine.hf import load_document

    st = trimmed_store(tmp_path_factory, tiny_lm, {"faq.md": 300})
    base = {"budget": 0.3, "quant": "ec", "keep": 0.5, "protect": 16, "scorer": "sentences", "lift": "sentences"}
    with st.writer():
        held = compress_document(st, "faq.md", CompressRecipe(**base, refit=0.01, refit_hold=True), lm=tiny_lm)
        free = compress_document(st, "faq.md", CompressRecipe(**base, refit=0.01), lm=tiny_lm)
        plain = compress_document(st, "faq.md", CompressRecipe(**base), lm=tiny_lm)
    assert "-rf0.01h-" in held.label and held.bytes <= 0.3 * fp16_size(st, "faq.md")
    a, b, c = (load_document(tiny_lm, st, "faq.md", x.label) for x in (held, free, plain))
    assert a.keys[0].shape == b.keys[0].shape == c.keys[0].shape
    assert not torch.allclose(a.values[-1], b.values[-1]) and not torch.allclose(a.values[-1], c.values[-1])


@pytest.fixture(scope="module")
def refit_versions(tiny_lm, tmp_path_factory):
    """The tiny model's faq.md refitted three ways (plain, ``--refit-decoded``, ``--refit-feedback``)
    and, per layer, the keys the decoded refit fitted to (``kept_keys``, seen in ``refit_values``)."""
    from budgetkit import trimmed_store

    import kdnctl.compress.stages.refit as ce
    from kdnctl.compress.document import CompressRecipe, compress_document

    seen: list = []

    def spy(*args, **kw):
        seen.append(args[7] if len(args) > 7 else kw.get("kept_keys"))
        return refit_values(*args, **kw)

    st = trimmed_store(tmp_path_factory, tiny_lm, {"faq.md": 300})
    base = {"budget": 0.3, "quant": "ec", "keep": 0.5, "protect": 16, "scorer": "sentences", "refit": 0.01}
    out = {}
    with pytest.MonkeyPatch.context() as mp, st.writer():
        mp.setattr(ce, "refit_values", spy)
        for name, extra in (("decoded", {"refit_decoded": True}), ("feedback", {"refit_feedback": True}), ("plain", {})):
            del seen[:]
            out[name] = compress_document(st, "faq.md", CompressRecipe(**base, **extra), lm=tiny_lm)
            out[name + ".fitted_to"] = seen[:]
    return st, out


@pytest.mark.parametrize("flag", ["refit_decoded", "refit_feedback"])
def test_refit_options_need_a_refit(flag):
    from kdnctl.compress.document import CompressRecipe

    with pytest.raises(UsageError, match=flag):
        CompressRecipe(budget=0.3, quant="ec", keep=0.5, refit=0, **{flag: True})


def test_compress_with_refit_to_the_decoded_keys_end_to_end(tiny_lm, refit_versions):
    """``--refit-decoded`` through a real compress: the label and the recipe say so, the cap holds,
    the kept tokens are the plain refit's, and the keys the fit reads are the keys the version
    loads with (quantized, up to the codes a last small move of the scale flips), not the keys
    before quantization that the plain refit reads. (The tiny model's coarse values hide what
    this gives the attention output; ``test_a_fit_to_the_keys...`` has that, the real path's runs
    in docs/compression.md the rest.)"""
    from budgetkit import fp16_size

    from kdnctl.engine.hf import load_document

    st, v = refit_versions
    dec, plain, fitted_to = v["decoded"], v["plain"], v["decoded.fitted_to"]
    full = load_document(tiny_lm, st, "faq.md", "full")
    assert dec.label == plain.label.replace("-rf0.01-", "-rf0.01d-")
    assert st.get_version("faq.md", dec.label).recipe["steps"][-1]["refit_decoded"] is True
    assert dec.bytes <= 0.3 * fp16_size(st, "faq.md")
    a, b = load_document(tiny_lm, st, "faq.md", dec.label), load_document(tiny_lm, st, "faq.md", plain.label)
    assert a.keys[0].shape == b.keys[0].shape and a.keys[0].shape[2] < full.keys[0].shape[2]
    assert not torch.allclose(a.values[-1], b.values[-1])
    assert len(fitted_to) == len(full.keys) and all(k is None for k in v["plain.fitted_to"])
    kept = torch.cat([torch.nonzero(c.kept).flatten() + c.start for c in _kept_chunks(st, dec.label)])
    for i, kk in enumerate(fitted_to):
        loaded, exact = a.keys[i][0].float(), full.keys[i][0][:, kept].float()
        assert kk.shape == loaded.shape
        assert float((kk - loaded).pow(2).mean()) < 0.1 * float((exact - loaded).pow(2).mean())


def _kept_chunks(st, label):
    """Each chunk's ``kept`` mask and first token in the document (``SimpleNamespace``)."""
    from types import SimpleNamespace

    from kdnctl.format.bundle import decode_bundle

    out, start = [], 0
    for c in st.get_version("faq.md", label).chunks:
        kept = decode_bundle(st.read_object(c.object)).tensors["kept"].bool()
        out.append(SimpleNamespace(kept=kept, start=start))
        start += kept.numel()
    return out


@pytest.mark.parametrize("s,d", [(1, 3), (9, 5), (23, 17)])
def test_rounding_with_feedback_equals_the_naive_optimum_after_each_rounding(s, d):
    from kdnctl.compress.feedback import naive_round_with_feedback, round_with_feedback

    g = torch.Generator().manual_seed(s + d)
    a = torch.softmax(torch.randn(40, s, generator=g) * 2, -1)
    h = (a.T @ a).double() + 0.01 * torch.eye(s, dtype=torch.float64)
    x = torch.randn(s, d, generator=g)
    mean = torch.randn(d, generator=g) * 0.1
    div = (torch.rand(s, d, generator=g) * 0.4 + 0.2) / torch.pow(2.0, torch.randint(0, 3, (s, 1), generator=g).float())
    order = torch.randperm(s, generator=g)
    fast = round_with_feedback(x, h, mean, div, order)
    torch.testing.assert_close(fast, naive_round_with_feedback(x, h, mean, div, order), rtol=1e-4, atol=1e-4)
    k = (fast - mean) / div  # every token on its own grid
    torch.testing.assert_close(k, k.round(), rtol=0, atol=1e-3)


@pytest.mark.parametrize("s,d", [(1, 3), (2, 1), (9, 5), (23, 17), (130, 64)])
def test_compiled_rounding_with_feedback_equals_its_torch_reference_bit_for_bit(s, d):
    from kdnctl.compress.feedback import round_with_feedback

    g = torch.Generator().manual_seed(100 + s + d)
    a = torch.softmax(torch.randn(50, s, generator=g) * 2, -1)
    h = (a.T @ a).double() + 0.01 * torch.eye(s, dtype=torch.float64)
    x = torch.randn(s, d, generator=g) * 3
    mean = torch.randn(d, generator=g) * 0.1
    div = (torch.rand(s, d, generator=g) * 0.4 + 0.05) / torch.pow(2.0, torch.randint(0, 4, (s, 1), generator=g).float())
    order = torch.randperm(s, generator=g)
    fast = round_with_feedback(x, h, mean, div, order)
    assert torch.equal(fast, round_with_feedback(x, h, mean, div, order, compiled=False))


@pytest.mark.parametrize("seed", range(4))
def test_feedback_order_holds_first_then_the_most_read(seed):
    """``rounding_order`` against its rule as a sort key, element by element (ties included)."""
    from kdnctl.compress.feedback import rounding_order

    g = torch.Generator().manual_seed(seed)
    read = torch.randint(0, 4, (37,), generator=g).double() / 3  # many ties
    held = torch.rand(37, generator=g) < 0.3
    want = sorted(range(37), key=lambda t: (not bool(held[t]), -float(read[t]), t))
    assert rounding_order(read, held).tolist() == want


def test_feedback_costs_less_through_the_normal_matrix_than_plain_rounding():
    """Summed over cases, the quadratic cost (q - x)^T H (q - x) the refit's objective pays for
    rounding is lower with feedback than with each token rounded on its own."""
    from kdnctl.compress.feedback import round_with_feedback

    fed = plain = 0.0
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        a = torch.softmax(torch.randn(60, 30, generator=g) * 3, -1)
        h = (a.T @ a).double() + 1e-3 * torch.eye(30, dtype=torch.float64)
        x, mean, div = torch.randn(30, 8, generator=g), torch.zeros(8), torch.full((30, 8), 0.5)
        order = torch.argsort(h.diagonal(), descending=True)
        cost = lambda q: float(torch.einsum("sd,st,td->", (q - x).double(), h, (q - x).double()))  # noqa: E731
        fed += cost(round_with_feedback(x, h, mean, div, order))
        plain += cost(mean + torch.round((x - mean) / div) * div)
    assert fed < 0.9 * plain


def test_compress_with_feedback_end_to_end(tiny_lm, refit_versions):
    """``--refit-feedback`` through a real compress: the label says so, the cap holds, the kept
    tokens are the plain refit's, and the stored values give the document's own queries an
    attention output nearer the full cache's in most layers (the tiny model's values are coarse:
    rounding is most of its error)."""
    from budgetkit import fp16_size, layers_read_nearer

    from kdnctl.engine.hf import load_document

    st, v = refit_versions
    fed, plain = v["feedback"], v["plain"]
    full = load_document(tiny_lm, st, "faq.md", "full")
    assert fed.label == plain.label.replace("-rf0.01-", "-rf0.01f-") and fed.bytes <= 0.3 * fp16_size(st, "faq.md")
    assert st.get_version("faq.md", fed.label).recipe["steps"][-1]["refit_feedback"] is True
    a, b = load_document(tiny_lm, st, "faq.md", fed.label), load_document(tiny_lm, st, "faq.md", plain.label)
    assert a.keys[0].shape == b.keys[0].shape
    assert layers_read_nearer(tiny_lm, full, a, b) >= 0.8 * len(full.keys)


def test_the_refit_reads_its_queries_from_the_key_weights_forward(tiny_lm, tmp_path_factory, monkeypatch):
    """A first compress of a document with a refit reads the refit's queries from the forward that
    measures the key weights: one decoder pass in all, where a compress whose key weights are
    already known runs the refit's own, and the same objects byte for byte."""
    from budgetkit import trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.models import adapter_for
    from kdnctl.quant.sensitivity import forget_key_weights

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1764000000")  # the writer's stamp: the same bytes from both
    recipe = CompressRecipe(budget=0.3, quant="ec", keep=0.5, protect=16, scorer="sentences", lift="literals",
                            refit=0.01, refit_hold=True, refit_decoded=True, refit_feedback=True, key_basis="none",
                            layers="even")  # (no Fisher profile to measure: the refit's passes alone are counted)
    calls: list[int] = []
    handle = adapter_for(tiny_lm.model).decoder.register_forward_pre_hook(lambda *_: calls.append(1))
    objects, passes = [], []
    try:
        for first in (True, False):
            st = trimmed_store(tmp_path_factory, tiny_lm, {"faq.md": 300})
            if first:
                forget_key_weights()
            del calls[:]
            with st.writer():
                res = compress_document(st, "faq.md", recipe, lm=tiny_lm)
            passes.append(len(calls))
            objects.append([st.read_object(c.object) for c in st.get_version("faq.md", res.label).chunks])
    finally:
        handle.remove()
    assert passes == [1, 1] and objects[0] == objects[1]


def test_a_long_documents_refit_reads_its_queries_from_the_stored_cache(tiny_lm, tmp_path_factory, monkeypatch):
    """Where the picked query rows are at most half of the document, the refit stage reads their
    queries from the stored K/V instead of a forward over the whole document (no key-weight
    forward runs; the key weights are ingest's recorded ones), and fits to the same queries as
    that forward gives."""
    from budgetkit import fp16_size, trimmed_store

    import kdnctl.compress.stages.refit as ce
    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.compress.refit import query_rows as rows_of
    from kdnctl.engine.hf import load_document
    from kdnctl.quant.sensitivity import forget_key_weights

    st = trimmed_store(tmp_path_factory, tiny_lm, {"faq.md": 300})
    monkeypatch.setattr(ce, "query_rows", lambda n: rows_of(n, 64))  # 64 rows of 300 tokens
    seen: dict = {}
    real_refit_queries, real_key_weights = ce.refit_queries, ce.key_weights

    def spy_queries(*args, **kw):
        out = real_refit_queries(*args, **kw)
        seen.setdefault("queries", []).append(out[0])
        return out

    def spy_weights(*args, **kw):
        seen["forward"] = seen.get("forward", 0) + 1
        return real_key_weights(*args, **kw)

    monkeypatch.setattr(ce, "refit_queries", spy_queries)
    monkeypatch.setattr(ce, "key_weights", spy_weights)
    base = {"budget": 0.3, "quant": "ec", "keep": 0.5, "protect": 16, "scorer": "sentences", "refit": 0.01}
    with st.writer():
        cached = compress_document(st, "faq.md", CompressRecipe(**base), lm=tiny_lm, label="cached")
        assert "forward" not in seen
        monkeypatch.setattr(ce, "reads_stored_cache", lambda job, pick: False)
        forget_key_weights()  # (the forward runs and reads the picked rows, whatever ran before)
        forward = compress_document(st, "faq.md", CompressRecipe(**base), lm=tiny_lm, label="forward")
        assert seen["forward"] == 1
    # the cached run read its fit's queries and the held-out ones that check each head's fit;
    # the forward's run only the fit's
    from_cache, held_out, from_forward = seen["queries"]
    assert len(from_cache) == len(from_forward) == 2 and from_cache[0].shape[1] == 64
    assert held_out[0].shape[0] == from_cache[0].shape[0] and 0 < held_out[0].shape[1] <= 64
    for a, b in zip(from_cache, from_forward):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
    cap = 0.3 * fp16_size(st, "faq.md")
    assert cached.bytes <= cap and forward.bytes <= cap
    a, b = load_document(tiny_lm, st, "faq.md", "cached"), load_document(tiny_lm, st, "faq.md", "forward")
    assert a.keys[0].shape == b.keys[0].shape


def test_the_stored_cache_is_read_only_from_a_prefill_in_the_models_dtype(tiny_lm, tmp_path_factory, monkeypatch):
    """K/V stored in another dtype (``--kv-dtype``) or a document shorter than twice the picked
    rows: the refit's queries come from the forward."""
    import kdnctl.compress.stages.refit as ce
    from kdnctl.compress.refit import query_rows as rows_of
    from kdnctl.compress.stages.base import Job

    def job(dtype, n):
        k = torch.zeros(2, n, 16, dtype=dtype)
        return Job(src=type("V", (), {"mode": "prefix"})(), label="x", step={}, recipe=None, bundles=[], keys=[k],
                   values=[k], token_ids=list(range(n)), local_bounds=[(0, n)], fp16=0, lm=tiny_lm,
                   dense=[[(k, k)]], all_keys=[k.float()], all_values=[k.float()])

    # (no recorded key weights in these made-up jobs: even the eligible shape falls back)
    assert not ce.reads_stored_cache(job(torch.float32, 300), rows_of(300, 64))
    monkeypatch.setattr(ce, "recorded_key_weights", lambda *a, **k: torch.zeros(1))
    assert ce.reads_stored_cache(job(torch.float32, 300), rows_of(300, 64))
    assert not ce.reads_stored_cache(job(torch.float16, 300), rows_of(300, 64))
    assert not ce.reads_stored_cache(job(torch.float32, 100), rows_of(100, 64))


@pytest.mark.parametrize("n_tokens,picked", [(300, 64), (2048, 1024), (8000, 1024)])
def test_held_out_rows_are_spread_over_the_document_and_never_picked(n_tokens, picked):
    from kdnctl.compress.refit import query_rows
    from kdnctl.compress.stages.refit import CHECK_ROWS, held_out_rows

    pick = query_rows(n_tokens, picked)
    rows = held_out_rows(n_tokens, pick)
    assert 0 < rows.numel() <= CHECK_ROWS and not torch.isin(rows, pick).any()
    assert torch.equal(rows, rows.unique()) and rows[0] < n_tokens // 8 and rows[-1] > n_tokens * 7 // 8
