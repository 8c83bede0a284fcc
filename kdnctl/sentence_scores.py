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


def token_texts(tokenizer, token_ids: list[int]) -> list[str]:
    """Each token decoded alone (byte-level pieces that are not whole characters decode to a
    replacement character, which never ends a sentence)."""
    return [tokenizer.decode([int(i)]) for i in token_ids]
