"""The ``sentences`` scorer: every token gets the mean surprisal of its sentence.

A question about a document asks for its information, and the model's own surprisal (-log p of
each token given the prefix, recorded at ingest) measures where the information is. Per token
it is a poor guide to what to keep: in a planted fact ("The maintenance access code for this
tool is 36964.") the topic words are in the top 1-3% of the document's surprisal but the digits
only around the 60th percentile, and a question needs both the words it matches and the value
it copies. Scored per sentence (a run of tokens ending at a newline or at ``.``/``?``/``!``),
the whole fact is kept or dropped together; the mean (not the sum) prefers short dense
sentences over long ordinary ones (``bench/lowbit_probe.py``, docs/compression.md).

The score is the same for every layer and KV head (a kept sentence is whole in every head);
ties inside a sentence break by the token's own surprisal.
"""

from __future__ import annotations

import torch

ENDS = (".", "?", "!")


def sentence_bounds(token_texts: list[str]) -> list[tuple[int, int]]:
    """``[start, end)`` of each sentence: a run ending at a token holding a newline or ending
    (before trailing spaces) in ``.``, ``?`` or ``!``; the last run ends at the last token."""
    out, start = [], 0
    for j, t in enumerate(token_texts):
        if "\n" in t or t.rstrip().endswith(ENDS) or j == len(token_texts) - 1:
            out.append((start, j + 1))
            start = j + 1
    return out


def sentence_surprisal(surprisal: torch.Tensor, token_texts: list[str]) -> torch.Tensor:
    """``[T]`` per-token surprisal -> ``[T]`` scores: the mean over the token's sentence, plus a
    tie-break (1e-3 x the token's surprisal rank in [0, 1])."""
    s = surprisal.float().reshape(-1)
    t = s.shape[0]
    if len(token_texts) != t:
        raise ValueError(f"{len(token_texts)} token texts for {t} surprisal values")
    out = torch.zeros(t)
    for a, b in sentence_bounds(token_texts):
        out[a:b] = s[a:b].mean()
    if t > 1:
        out += 1e-3 * s.argsort().argsort().float() / (t - 1)
    return out


ISOLATED_MAX_TOKENS = 64  # a sentence scored alone: its first 64 tokens


def isolated_sentence_surprisal(lm, token_ids: list[int], bounds: list[tuple[int, int]],
                                batch: int = 64) -> torch.Tensor:
    """``[T]``: each token gets the mean -log p of its sentence's tokens (from the second, up to
    ``ISOLATED_MAX_TOKENS``) with NOTHING before the sentence. In context, a fact that repeats a
    template ("The locker code of the juniper group is 9793." after three others) is predictable
    and scores like prose; alone it is as surprising as the first one. Sentences are batched by
    length (padding on the right, causal attention: padding never reaches a real token)."""
    out = torch.zeros(len(token_ids))
    segs = [((a, min(b, a + ISOLATED_MAX_TOKENS)), (a, b)) for a, b in bounds if b - a >= 2]
    segs.sort(key=lambda s: s[0][1] - s[0][0])
    for i in range(0, len(segs), batch):
        part = segs[i:i + batch]
        n = max(b - a for (a, b), _ in part)
        x = torch.zeros(len(part), n, dtype=torch.long)
        for r, ((a, b), _) in enumerate(part):
            x[r, :b - a] = torch.tensor(token_ids[a:b])
        with torch.inference_mode():
            logits = lm.model(input_ids=x.to(lm.device)).logits.float().cpu()
        nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
        for r, ((a, b), (fa, fb)) in enumerate(part):
            out[fa:fb] = nll[r, :b - a - 1].mean()
    return out


def facts_scores(surprisal: torch.Tensor, lm, token_ids: list[int], texts: list[str]) -> torch.Tensor:
    """The ``facts`` scorer: per sentence, the better of two ranks: the mean surprisal in context
    (:func:`sentence_surprisal`) and alone (:func:`isolated_sentence_surprisal`); ties break
    by the token's own surprisal rank."""
    bounds = sentence_bounds(texts)
    ctx = sentence_surprisal(surprisal, texts)
    iso = isolated_sentence_surprisal(lm, token_ids, bounds)
    t = len(token_ids)

    def rank(x: torch.Tensor) -> torch.Tensor:
        return x.argsort().argsort().float() / max(t - 1, 1)

    return torch.maximum(rank(ctx), rank(iso)) + 1e-3 * rank(surprisal.float().reshape(-1))


def token_texts(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token decoded alone (byte-level pieces that are not whole characters decode to a
    replacement character, which never ends a sentence)."""
    return [tokenizer.decode([int(i)]) for i in token_ids]
