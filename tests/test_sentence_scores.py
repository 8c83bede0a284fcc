"""The ``sentences`` scorer: a sentence is scored by its mean surprisal, whole."""

import pytest
import torch

from kdnctl.scoring import compute_importance
from kdnctl.sentence_scores import sentence_bounds, sentence_surprisal, token_texts


def test_bounds_end_at_newlines_and_sentence_ends():
    toks = ["NAME", "\n", "The", " code", " is", " 12", "34", ".", " Next", " one", "?", " tail"]
    assert sentence_bounds(toks) == [(0, 2), (2, 8), (8, 11), (11, 12)]
    assert sentence_bounds([]) == []
    assert sentence_bounds(["one"]) == [(0, 1)]


def test_mean_per_sentence_keeps_a_fact_whole():
    # a dense short fact (topic word very surprising, digits medium) between ordinary sentences
    toks = ["A", " plain", " line", ".\n", "The", " maintenance", " code", " is", " 3", "6", ".\n", "more", " text", "\n"]
    s = torch.tensor([2.0, 1.0, 1.5, 0.5, 3.0, 12.0, 6.0, 0.4, 2.4, 2.3, 1.4, 2.0, 2.2, 0.3])
    out = sentence_surprisal(s, toks)
    assert out.shape == (14,)
    fact = out[4:11]
    assert float(fact.min()) > float(torch.cat([out[:4], out[11:]]).max())  # the fact outranks the rest, whole
    assert torch.allclose(fact, torch.full((7,), float(s[4:11].mean())), atol=1.1e-3)  # tie-break < 1e-3
    # ties inside a sentence break by the token's own surprisal
    assert int(fact.argmax()) == 1


def test_mean_not_sum_prefers_dense_to_long():
    toks = [" w"] * 20 + ["\n"] + [" x", " y", "\n"]
    s = torch.cat([torch.full((21,), 2.0), torch.tensor([4.0, 4.0, 1.0])])
    out = sentence_surprisal(s, toks)
    assert float(out[22]) > float(out[0])


def test_length_mismatch_is_refused():
    with pytest.raises(ValueError):
        sentence_surprisal(torch.ones(3), ["a", "b"])


def test_scorer_on_the_real_tokenizer(lm):
    text = "NAME\nls - list directory contents\n\nThe maintenance access code for this tool is 36964.\nls lists files."
    ids = lm.tokenizer(text, add_special_tokens=False).input_ids
    texts = token_texts(lm.tokenizer, ids)
    assert "".join(texts) == text
    surprisal = torch.rand(len(ids), generator=torch.Generator().manual_seed(0))
    imp = compute_importance("sentences", {"surprisal": surprisal}, lm=lm, token_ids=ids, n_layers=2, n_heads=3)
    assert imp.shape == (2, 3, len(ids))
    assert torch.equal(imp[0, 0], imp[1, 2])  # the same for every layer and head
    starts = {a for a, _ in sentence_bounds(texts)}
    code = next(i for i in range(len(ids)) if "maint" in texts[i])
    start = max(a for a in starts if a <= code)
    end = min(b for _, b in sentence_bounds(texts) if b > code)
    assert "36964" in "".join(texts[start:end]).replace(" ", "")
    assert float((imp[0, 0, start:end] - imp[0, 0, start]).abs().max()) < 1.1e-3  # one sentence, one score


def test_facts_scores_lift_a_repeated_template_fact(lm):
    """In context a fact repeating an earlier one's template is predictable; scored alone it is
    not: ``facts`` ranks it at least as high as ``sentences`` does, and isolated scores use no
    context (the same sentence scores the same wherever it stands)."""
    from kdnctl.sentence_scores import facts_scores, isolated_sentence_surprisal

    prose = "ls lists information about the files in the current directory by default.\n"
    text = ("NAME\nls - list directory contents\n" + "The locker code of the meadow group is 7129.\n" + prose * 3
            + "The locker code of the juniper group is 9793.\n" + prose)
    ids = lm.tokenizer(text, add_special_tokens=False).input_ids
    texts = token_texts(lm.tokenizer, ids)
    bounds = sentence_bounds(texts)
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([ids])).logits[0].float()
    surprisal = torch.cat([torch.zeros(1), -torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]])
    iso = isolated_sentence_surprisal(lm, ids, bounds, batch=2)
    prose_bounds = [(a, b) for a, b in bounds if "".join(texts[a:b]).strip() == prose.strip()]
    assert len(prose_bounds) == 4
    assert len({round(float(iso[a]), 4) for a, _ in prose_bounds}) == 1  # no context: same sentence, same score
    facts = facts_scores(surprisal, lm, ids, texts)
    ctx = sentence_surprisal(surprisal, texts)
    later = next(a for a, b in bounds if "juniper" in "".join(texts[a:b]))
    rank = lambda x: int((x > x[later]).sum())  # noqa: E731  sentences ahead of the later fact
    assert rank(facts) <= rank(ctx)
    assert float(facts.max()) <= 1.0 + 1.1e-3 and float(facts.min()) >= 0
