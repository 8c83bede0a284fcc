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

