"""The ``sentences`` scorer: a sentence is scored by its mean surprisal, whole."""

import pytest
import torch

from kdnctl.scorers import compute_importance
from kdnctl.scorers.sentences import sentence_bounds, sentence_surprisal, token_texts


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



def _naive_local(lm, ids, bounds, window):
    """Reference: one unpadded forward per sentence over its window and itself, full log-softmax."""
    out = []
    for a, b in bounds:
        c = max(0, a - window)
        x = torch.tensor([ids[c:b]])
        with torch.inference_mode():
            logp = torch.log_softmax(lm.model(input_ids=x).logits[0].float(), -1)
        nll = [-float(logp[j - c - 1, ids[j]]) for j in range(max(a, c + 1), b)]
        out.append(sum(nll) / len(nll) if nll else 0.0)
    return torch.tensor(out)


@pytest.mark.parametrize("window,batch_tokens", [(0, 8192), (5, 40), (16, 8192)])
def test_local_surprisal_batched_equals_naive(tiny_lm, window, batch_tokens):
    from kdnctl.scorers.sentences import local_sentence_surprisal

    text = ("NAME\nls - list.\n\nThe locker code of the juniper group is 9793. The locker code of the cedar group "
            "is 1234.\nA longer ordinary sentence about listing directory contents, sorted by name? x")
    ids = tiny_lm.tokenizer(text, add_special_tokens=False).input_ids
    bounds = sentence_bounds(token_texts(tiny_lm.tokenizer, ids))
    assert len(bounds) >= 5
    got = local_sentence_surprisal(tiny_lm, ids, bounds, window=window, batch_tokens=batch_tokens, pack=0)
    want = _naive_local(tiny_lm, ids, bounds, window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert float(got.std()) > 0


def _naive_rows(lm, ids, bounds, rows):
    """Reference for packed rows: one unpadded forward per row, each sentence's mean -log p in it."""
    out = torch.zeros(len(bounds))
    for c, sents in rows:
        b = bounds[sents[-1]][1]
        with torch.inference_mode():
            logp = torch.log_softmax(lm.model(input_ids=torch.tensor([ids[c:b]])).logits[0].float(), -1)
        for j in sents:
            sa, sb = bounds[j]
            nll = [-float(logp[k - c - 1, ids[k]]) for k in range(max(sa, c + 1), sb)]
            out[j] = sum(nll) / len(nll) if nll else 0.0
    return out


@pytest.mark.parametrize("window,pack,batch_tokens", [(5, 12, 40), (16, 30, 8192), (3, 1000, 8192)])
def test_local_surprisal_packed_rows_equal_naive(tiny_lm, window, pack, batch_tokens):
    """Rows that carry several sentences score each as one forward over the row does; the first
    sentence of every row as in a row of its own."""
    from kdnctl.scorers.sentences import local_rows, local_sentence_surprisal

    text = ("NAME\nls - list.\n\nThe locker code of the juniper group is 9793. The locker code of the cedar group "
            "is 1234.\nA longer ordinary sentence about listing directory contents, sorted by name? x y. z!\nend")
    ids = tiny_lm.tokenizer(text, add_special_tokens=False).input_ids
    bounds = sentence_bounds(token_texts(tiny_lm.tokenizer, ids))
    rows = local_rows(bounds, window, pack)
    assert [j for _, s in rows for j in s] == list(range(len(bounds)))  # every sentence once, in order
    assert any(len(s) > 1 for _, s in rows) and len(rows) < len(bounds)
    for c, s in rows:
        assert c == max(0, bounds[s[0]][0] - window)
        assert len(s) == 1 or bounds[s[-1]][1] - bounds[s[0]][0] <= pack
    got = local_sentence_surprisal(tiny_lm, ids, bounds, window=window, batch_tokens=batch_tokens, pack=pack)
    torch.testing.assert_close(got, _naive_rows(tiny_lm, ids, bounds, rows), rtol=1e-4, atol=1e-4)
    alone = _naive_local(tiny_lm, ids, bounds, window)
    firsts = [s[0] for _, s in rows]
    torch.testing.assert_close(got[firsts], alone[firsts], rtol=1e-4, atol=1e-4)


def test_sentences_local_takes_the_better_rank(tiny_lm):
    """A sentence ranked high by either signal ranks high; the score is whole per sentence."""
    from kdnctl.scorers.sentences import local_sentence_scores

    text = "First line here.\nSecond line is longer than that.\nThird. Fourth one?\nlast"
    ids = tiny_lm.tokenizer(text, add_special_tokens=False).input_ids
    bounds = sentence_bounds(token_texts(tiny_lm.tokenizer, ids))
    surprisal = torch.zeros(len(ids))
    a, b = bounds[1]
    surprisal[a:b] = 9.0  # the second sentence is the most surprising given the document
    imp = compute_importance("sentences-local", {"surprisal": surprisal}, lm=tiny_lm, token_ids=ids, n_layers=1, n_heads=2)
    s = imp[0, 0]
    assert float(s[a:b].min()) >= 1.0  # rank 1 of the whole-document signal, whatever the local one says
    local = local_sentence_scores(tiny_lm, torch.zeros(len(ids)), ids)
    per_sentence = [float(local[x]) for x, _ in bounds]
    assert max(per_sentence) >= 1.0 and len(set(round(v, 2) for v in per_sentence)) > 1
    for x, y in bounds:
        assert float((s[x:y] - s[x]).abs().max()) < 1.1e-3


def test_sentences_gap_ranks_what_the_document_predicts(tiny_lm):
    """``sentences-gap``: per sentence the better of the whole-document rank and the rank of the
    local surprisal plus GAP_WEIGHT x (local - whole), against a naive recomputation."""
    from kdnctl.scorers.sentences import GAP_WEIGHT, local_sentence_surprisal
    from kdnctl.scorers.rank import rank01

    text = "First line here.\nSecond line is longer than that.\nThird. Fourth one?\nFifth line, the last"
    ids = tiny_lm.tokenizer(text, add_special_tokens=False).input_ids
    bounds = sentence_bounds(token_texts(tiny_lm.tokenizer, ids))
    local = local_sentence_surprisal(tiny_lm, ids, bounds)
    target = 2  # whole-document surprisal far below its local one: the document predicts it
    surprisal = torch.zeros(len(ids))
    whole = []
    for i, (a, b) in enumerate(bounds):
        v = float(local[i]) - (100.0 if i == target else 0.0)
        surprisal[a:b] = v
        whole.append(v)
    got = compute_importance("sentences-gap", {"surprisal": surprisal}, lm=tiny_lm, token_ids=ids, n_layers=2, n_heads=1)
    assert got.shape == (2, 1, len(ids)) and torch.equal(got[0], got[1])
    whole = torch.tensor(whole)
    want = torch.maximum(rank01(whole), rank01(local + GAP_WEIGHT * (local - whole)))
    a, b = bounds[target]
    assert float(got[0, 0, a:b].min()) >= 1.0  # the largest gap, whatever its own surprisal
    for i, (x, y) in enumerate(bounds):
        assert float((got[0, 0, x:y] - want[i]).abs().max()) < 1.1e-3
    plain = compute_importance("sentences-local", {"surprisal": surprisal}, lm=tiny_lm, token_ids=ids, n_layers=1, n_heads=1)
    assert not torch.allclose(plain[0, 0], got[0, 0])
