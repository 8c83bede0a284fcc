"""A margin for the answer-bearing tokens (``--lift literals --lift-share S --lift-level N``): the
``literals`` scorer against a naive loop (odd sizes, fixed seeds), its order on the real
tokenizer, ``token_levels`` lifting exactly the share and level asked, the recipe's spelling,
record, label and refusals, and a real compress with the tiny model that stores the top of the
kept tokens by the scorer at the asked level, within its cap."""

from __future__ import annotations

import pytest
import torch

from kdnctl.compress.stages.precision import token_levels
from kdnctl.errors import UsageError
from kdnctl.scorers.literals import DIGIT, SENTENCE, literal_scores
from kdnctl.scorers.sentences import sentence_bounds
from kdnctl.quant import layer_kv

WORDS = ["The", " port", " is", " ", "8", "7", "8", "4", ".", " It", " runs", "\n", " v", "2", " ok", "!", " end"]


def _naive(surprisal: list[float], texts: list[str]) -> list[float]:
    """Reference: a token's class (digit 2, a digit's sentence 1, else 0) plus 0.999 x the rank of
    its surprisal among all tokens (0 = lowest, ties to the earlier token), over T - 1."""
    n = len(texts)
    order = sorted(range(n), key=lambda j: (surprisal[j], j))
    rank = {j: r / max(n - 1, 1) for r, j in enumerate(order)}
    out = []
    for j, t in enumerate(texts):
        a, b = next((a, b) for a, b in sentence_bounds(texts) if a <= j < b)
        if any(c.isdigit() for c in t):
            cls = 2.0
        elif any(any(c.isdigit() for c in texts[k]) for k in range(a, b)):
            cls = 1.0
        else:
            cls = 0.0
        out.append(cls + 0.999 * rank[j])
    return out


@pytest.mark.parametrize("n,seed", [(17, 0), (41, 1), (1, 2), (103, 3)])
def test_literal_scores_equal_the_naive_loop(n, seed):
    g = torch.Generator().manual_seed(seed)
    texts = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g)]
    surprisal = torch.rand(n, generator=g)
    got = literal_scores(surprisal, texts)
    want = torch.tensor(_naive(surprisal.tolist(), texts))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    # the classes never mix: every digit above every other token of its sentence, those above the rest
    digit = torch.tensor([any(c.isdigit() for c in t) for t in texts])
    if bool(digit.any()) and bool((~digit).any()):
        assert float(got[digit].min()) > float(got[~digit].max())
    assert float(got.max()) < DIGIT + 1 and SENTENCE == 1.0


def test_literal_scores_refuse_a_length_mismatch():
    with pytest.raises(ValueError, match="token texts"):
        literal_scores(torch.zeros(3), ["a", "b"])


def test_literals_on_the_real_tokenizer(lm):
    from kdnctl.scorers import compute_importance
    from kdnctl.scorers.sentences import token_texts

    text = "NAME\nls - list directory contents\n\nThe port for the marlin service is 8784.\nls lists files."
    ids = lm.tokenizer(text, add_special_tokens=False).input_ids
    texts = token_texts(lm.tokenizer, ids)
    surprisal = torch.rand(len(ids), generator=torch.Generator().manual_seed(0))
    imp = compute_importance("literals", {"surprisal": surprisal}, lm=lm, token_ids=ids, n_layers=2, n_heads=3)
    assert imp.shape == (2, 3, len(ids)) and torch.equal(imp[0, 0], imp[1, 2])
    top = imp[0, 0].argsort(descending=True)
    digits = [j for j, t in enumerate(texts) if any(c.isdigit() for c in t)]
    assert "".join(texts[j] for j in digits).strip() == "8784"  # one token a digit with this tokenizer
    assert sorted(top[: len(digits)].tolist()) == digits
    service = next(j for j, t in enumerate(texts) if t == " service")
    ls = next(j for j, t in enumerate(texts) if t.strip() == "ls")
    assert float(imp[0, 0, service]) > float(imp[0, 0, ls])  # the fact's words before the other text


@pytest.mark.parametrize("n,share,level,header,protect", [(37, 0.1, 2, 3, 5), (50, 0.3, 1, 4, 8), (11, 1.0, 2, 0, 0)])
def test_token_levels_lift_the_share_and_level_asked(n, share, level, header, protect):
    g = torch.Generator().manual_seed(n)
    lift = torch.rand(2, 3, n, generator=g)
    levels = token_levels(n, header, protect, lift, 2, (share, level))
    score = lift.mean((0, 1))
    top = sorted(range(n), key=lambda t: (-float(score[t]), t))[: int(share * n)]
    want = torch.zeros(n, dtype=torch.uint8)
    want[top] = level
    if protect:
        want[-protect:] = 2
    want[:header] = 2
    assert torch.equal(levels, want)


def test_recipe_lift_share_and_level():
    from kdnctl.compress.document import CompressRecipe
    from kdnctl.recipes import Recipe

    plain = CompressRecipe(budget=0.083, lift="literals")
    assert plain.lift_steps == (0.25, 1) and "lift_share" not in plain.as_dict()
    r = CompressRecipe(budget=0.083, lift="literals", lift_share=0.08, lift_level=2)
    assert r.lift_steps == (0.08, 2)
    assert r.as_dict()["lift_share"] == 0.08 and r.as_dict()["lift_level"] == 2
    assert r.default_label() == "ec-b0.083-k0.5-p32-lliterals0.08x2-rf0.01hdf-sentences-gap"
    toml = Recipe(name="x", compress={"budget": 0.083, "quant": "ec", "keep": 0.5, "protect": 32, "scorer": "sentences-gap",
                                      "lift": "literals", "lift_share": 0.08, "lift_level": 2, "refit": 0.01,
                                      "refit_hold": True, "refit_decoded": True, "refit_feedback": True})
    assert toml.compress_recipe().default_label() == r.default_label()
    assert CompressRecipe(budget=0.083, lift="literals", lift_share=0.06, lift_level=4).lift_steps == (0.06, 4)
    for bad, match in [(dict(lift_share=0.1, lift="none"), "set how ec lifts"), (dict(lift="literals", lift_level=5), "lift_level"),
                       (dict(lift="literals", lift_level=4, backfill="18.2", backfill_shift=3), "finest level"),
                       (dict(lift="literals", lift_share=0), "lift_share"), (dict(lift="literals", lift_share=1.5), "lift_share"),
                       (dict(lift="literals", lift_level=True), "lift_level")]:
        with pytest.raises(UsageError, match=match):
            CompressRecipe(budget=0.083, **bad)
    with pytest.raises(UsageError, match="set how ec lifts"):  # ec's levels only
        CompressRecipe(budget=0.25, quant="ladder", lift="literals", lift_share=0.1)


def test_compress_with_a_literal_lift_end_to_end(tiny_lm, tmp_path_factory):
    """The tiny model: within the cap, the same kept tokens as without the lift, and exactly the
    top share of them by the literals scorer 4x finer (the header and the tail as before)."""
    from budgetkit import fp16_size, trimmed_store

    from kdnctl.format.bundle import decode_bundle
    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.compress.stages.score import cat_stats as _cat_stats
    from kdnctl.scorers import compute_importance

    st = trimmed_store(tmp_path_factory, tiny_lm, {"meeting-notes-2026-03.txt": 300})
    doc = "meeting-notes-2026-03.txt"
    base = dict(budget=0.3, quant="ec", keep=0.5, protect=16, scorer="sentences")
    with st.writer():
        on = compress_document(st, doc, CompressRecipe(**base, lift="literals", lift_share=0.1, lift_level=2), lm=tiny_lm)
        off = compress_document(st, doc, CompressRecipe(**base), lm=tiny_lm)
    assert on.label.endswith("-lliterals0.1x2-sentences") and on.bytes <= 0.3 * fp16_size(st, doc)

    def bundles(label):
        return [decode_bundle(st.read_object(c.object)) for c in st.get_version(doc, label).chunks]

    kept = torch.cat([b.layer_positions(0)[0] for b in bundles(on.label)]).long()
    assert torch.equal(kept, torch.cat([b.layer_positions(0)[0] for b in bundles(off.label)]).long())
    full = bundles("full")
    ids = [int(t) for b in full for t in b.token_ids.tolist()]
    header = int(full[0].meta.get("header_tokens", 0))
    lit = compute_importance("literals", _cat_stats(full), lm=tiny_lm, token_ids=ids, n_layers=full[0].n_layers,
                             n_heads=layer_kv(full[0], 0)[0].shape[0])
    from kdnctl.scorers.rank import rank01

    want = token_levels(kept.numel(), header, 16, rank01(lit)[..., kept], 2, (0.1, 2))
    got = torch.cat([b.tensors["token_levels"] for b in bundles(on.label)])
    assert torch.equal(got, want)
    texts = [tiny_lm.tokenizer.decode([ids[int(t)]]) for t in kept]
    digits = [j for j, t in enumerate(texts) if any(c.isdigit() for c in t)]
    assert digits and all(int(got[j]) == 2 for j in digits[: int(0.1 * kept.numel())])
    off_levels = torch.cat([b.tensors["token_levels"] for b in bundles(off.label)])
    assert int((got == 2).sum()) > int((off_levels == 2).sum())  # the lift, beyond the header and tail


def test_a_lift_of_several_scorers_ranks_by_the_best_of_them(tiny_lm, tmp_path_factory):
    """``lift=literals+sentences``: each token's lift rank is the better of its two ranks (the
    recipe's own scorer's ranks reused), the top share of the kept tokens by it stored finer; an
    unknown name among them is refused before any work."""
    from budgetkit import trimmed_store

    from kdnctl.format.bundle import decode_bundle
    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.compress.stages.score import cat_stats as _cat_stats
    from kdnctl.scorers import compute_importance
    from kdnctl.scorers.rank import rank01

    with pytest.raises(UsageError, match="unknown scorer 'bogus'"):
        CompressRecipe(budget=0.3, quant="ec", keep=0.5, scorer="sentences", lift="literals+bogus")
    st = trimmed_store(tmp_path_factory, tiny_lm, {"meeting-notes-2026-03.txt": 300})
    doc = "meeting-notes-2026-03.txt"
    recipe = CompressRecipe(budget=0.3, quant="ec", keep=0.5, protect=16, scorer="sentences", lift="literals+sentences",
                            lift_share=0.3, lift_level=2)
    with st.writer():
        res = compress_document(st, doc, recipe, lm=tiny_lm)
    bundles = [decode_bundle(st.read_object(c.object)) for c in st.get_version(doc, res.label).chunks]
    kept = torch.cat([b.layer_positions(0)[0] for b in bundles]).long()
    full = [decode_bundle(st.read_object(c.object)) for c in st.get_version(doc, "full").chunks]
    ids = [int(t) for b in full for t in b.token_ids.tolist()]
    n_layers, n_heads = full[0].n_layers, layer_kv(full[0], 0)[0].shape[0]
    ranks = [rank01(compute_importance(name, _cat_stats(full), lm=tiny_lm, token_ids=ids, n_layers=n_layers,
                                       n_heads=n_heads)) for name in ("literals", "sentences")]
    best = torch.maximum(*ranks)
    header = int(full[0].meta.get("header_tokens", 0))
    got = torch.cat([b.tensors["token_levels"] for b in bundles])
    assert torch.equal(got, token_levels(kept.numel(), header, 16, best[..., kept], 2, (0.3, 2)))
    for one in ranks:  # neither scorer alone lifts the same tokens
        assert not torch.equal(got, token_levels(kept.numel(), header, 16, one[..., kept], 2, (0.3, 2)))


def test_a_budget_name_made_by_an_earlier_default_says_how_to_keep_both(tiny_lm, tmp_path_factory):
    """``b0.5`` already made by another recipe (an earlier default of that budget): compressing with
    the budget's own recipe is refused before any work, with a hint to name the new version; another
    name then makes it beside the old one."""
    from budgetkit import trimmed_store

    from kdnctl.compress.document import CompressRecipe, compress_document

    st = trimmed_store(tmp_path_factory, tiny_lm, {"faq.md": 300})
    with st.writer():
        compress_document(st, "faq.md", CompressRecipe(budget=0.5, lift="none"), lm=tiny_lm, label="b0.5")
        objects = sorted(p.name for p in (st.root / "objects").rglob("*") if p.is_file())
        with pytest.raises(UsageError, match="earlier default recipe of --budget 0.5") as err:
            compress_document(st, "faq.md", CompressRecipe(budget=0.5), lm=tiny_lm)
        assert "--label" in err.value.hint
        assert sorted(p.name for p in (st.root / "objects").rglob("*") if p.is_file()) == objects
        new = compress_document(st, "faq.md", CompressRecipe(budget=0.5), lm=tiny_lm, label="b0.5-new")
    assert new.status == "compressed" and {"b0.5", "b0.5-new"} <= {v.label for v in st.list_versions("faq.md")}
