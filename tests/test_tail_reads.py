"""What the end of a document reads (kdnctl/scorers/tail_reads.py, ``--tail-reads``): per sentence the
mean attention from the document's last queries in the middle layers, against a naive loop; the
kept set fills its last share by it, against a naive fill; the recipe and a real compress with
the tiny model carry it."""

from __future__ import annotations

import pytest
import torch

from kdnctl.compress.stages.select import shared_keep
from kdnctl.errors import UsageError
from kdnctl.scorers.tail_reads import middle_layers, sentence_reads


def _bounds(t: int, seed: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(seed)
    cuts = sorted(set(torch.randint(1, t, (t // 5,), generator=g).tolist()))
    edges = [0, *cuts, t]
    return list(zip(edges[:-1], edges[1:]))


def test_middle_layers_are_the_middle_two_fifths():
    assert middle_layers(30) == range(12, 24)  # SmolLM2: where eviction was measured to cost most
    assert middle_layers(2) == range(0, 1) and len(middle_layers(1)) == 1


@pytest.mark.parametrize("n_layers,heads,t,seed", [(30, 3, 97, 0), (7, 2, 41, 1), (1, 1, 13, 2)])
def test_sentence_reads_equal_the_naive_mean(n_layers, heads, t, seed):
    g = torch.Generator().manual_seed(seed)
    window = torch.rand(n_layers, heads, t, generator=g)
    bounds = _bounds(t, seed)
    got = sentence_reads(window, bounds)
    layers = list(middle_layers(n_layers))
    for a, b in bounds:
        total = sum(float(window[i, h, j]) for i in layers for h in range(heads) for j in range(a, b))
        want = total / (len(layers) * heads * (b - a))
        assert torch.allclose(got[a:b], torch.full((b - a,), want, dtype=torch.float64), rtol=1e-6, atol=1e-9)
    # the tie-break only orders equals: later first, never past a different sentence mean
    same = sentence_reads(torch.ones(n_layers, heads, t), bounds)
    assert torch.equal(same.argsort(descending=True), torch.arange(t).flip(0))


def _naive_fill(score, second, keep, header, protect, share):
    t = score.shape[0]
    forced = [j for j in range(t) if j < header or j >= t - protect]
    want = max(round(keep * t), len(forced))
    free = want - len(forced)
    rest = sorted((j for j in range(t) if j not in forced), key=lambda j: (-float(score[j]), j))
    first = rest[:round((1 - share) * free)]
    taken = set(forced) | set(first)
    by_second = [j for j in sorted(range(t), key=lambda j: (-float(second[j]), j)) if j not in taken]
    return sorted(taken | set(by_second[:want - len(taken)]))


@pytest.mark.parametrize("t,keep,header,protect,share,seed", [(101, 0.33, 5, 7, 0.25, 0), (64, 0.5, 0, 0, 0.6, 1),
                                                                (37, 0.4, 3, 4, 0.3, 2), (50, 0.9, 2, 2, 0.5, 3)])
def test_shared_keep_fills_its_last_share_by_the_second_order(t, keep, header, protect, share, seed):
    g = torch.Generator().manual_seed(seed)
    importance = torch.rand(2, 3, t, generator=g)
    second = torch.rand(t, generator=g)
    got = shared_keep(importance, keep, header, protect, second, share).tolist()
    score = importance.mean((0, 1))
    assert got == _naive_fill(score, second, keep, header, protect, share)
    assert len(got) == max(round(keep * t), header + protect)
    plain = shared_keep(importance, keep, header, protect).tolist()
    assert plain == _naive_fill(score, second, keep, header, protect, 0.0)
    assert got != plain  # the share changed the set (these cases: the two orders differ)


def test_recipe_tail_reads_is_asked_for_recorded_and_labelled():
    from kdnctl.compress.document import CompressRecipe
    from kdnctl.recipes import Recipe

    auto = CompressRecipe(budget=0.083)
    assert auto.tail_reads is None and "tail_reads" not in auto.as_dict()
    on = CompressRecipe(budget=0.083, tail_reads=0.25)
    assert on.as_dict()["tail_reads"] == 0.25
    assert on.default_label() == "ec-b0.083-k0.5-p32-lliterals+sentences-gap0.3x2k-rf0.01hdf-tr0.25-sentences-gap"
    assert CompressRecipe(budget=0.083, tail_reads=0).default_label() == auto.default_label()
    with pytest.raises(UsageError, match="option tail_reads"):  # every token kept: nothing to choose
        CompressRecipe(budget=0.25, quant="ec", tail_reads=0.25)
    with pytest.raises(UsageError, match="share"):
        CompressRecipe(budget=0.083, tail_reads=1.0)
    r = Recipe(name="x", compress={"budget": 0.083, "quant": "ec", "keep": 0.5, "protect": 32,
                                   "scorer": "sentences-gap", "tail_reads": 0.25, "lift": "literals+sentences-gap",
                                   "lift_share": 0.3, "lift_level": 2, "lift_role": "keys", "refit": 0.01,
                                   "refit_hold": True, "refit_decoded": True, "refit_feedback": True})
    assert r.compress_recipe().default_label() == on.default_label()


def test_compress_with_tail_reads_end_to_end(tiny_lm, tmp_path_factory):
    """The tiny model: the version fits its cap, keeps as many tokens as the version without,
    and exactly the set shared_keep picks from the scorer and the document's own last queries."""
    from budgetkit import fp16_size, trimmed_store

    from kdnctl.format.bundle import decode_bundle
    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.compress.stages.score import cat_stats as _cat_stats
    from kdnctl.engine.prefill import prefill
    from kdnctl.scorers import compute_importance
    from kdnctl.scorers.sentences import sentence_bounds, token_texts
    from kdnctl.scorers.tail_reads import TAIL_WINDOW

    st = trimmed_store(tmp_path_factory, tiny_lm, {"faq.md": 300})
    base = dict(budget=0.3, quant="ec", keep=0.5, protect=16, scorer="sentences")
    with st.writer():
        on = compress_document(st, "faq.md", CompressRecipe(**base, tail_reads=0.5), lm=tiny_lm)
        off = compress_document(st, "faq.md", CompressRecipe(**base), lm=tiny_lm)
    assert on.label.endswith("-tr0.5-sentences") and on.bytes <= 0.3 * fp16_size(st, "faq.md")

    def bundles(label):
        return [decode_bundle(st.read_object(c.object)) for c in st.get_version("faq.md", label).chunks]

    def kept(label):
        return torch.cat([b.layer_positions(0)[0] for b in bundles(label)]).long()

    full = bundles("full")
    ids = [int(t) for b in full for t in b.token_ids.tolist()]
    header = int(full[0].meta.get("header_tokens", 0))
    window = prefill(tiny_lm.model, ids, stats=("window",), window=TAIL_WINDOW).stats["window"]
    second = sentence_reads(window, sentence_bounds(token_texts(tiny_lm.tokenizer, ids)))
    importance = compute_importance("sentences", _cat_stats(full), lm=tiny_lm, token_ids=ids,
                                    n_layers=full[0].n_layers, n_heads=window.shape[1])
    assert torch.equal(kept(on.label), shared_keep(importance, 0.5, header, 16, second, 0.5))
    assert torch.equal(kept(off.label), shared_keep(importance, 0.5, header, 16))
    assert kept(on.label).numel() == kept(off.label).numel() < len(ids)
    assert not torch.equal(kept(on.label), kept(off.label))
