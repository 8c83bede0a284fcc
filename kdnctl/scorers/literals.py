"""The ``literals`` scorer: the tokens an exact answer is copied from, for ``--lift``.

The values users ask for verbatim (ports, codes, versions, prices, dates) are numerals, and a
model copies them digit by digit: each generated digit is read back through the key and value of
one stored token, so at a coarse step a near tie between two digits flips the answer. The
model's own surprisal does not find them (a random digit costs about log 10 nats, around the
median of a kept set's tokens: ``research/probes/kept_answers.py --rank-by surprisal``). This scorer ranks
them by what they are: every token holding a digit first, then the other tokens of a sentence
that holds one (the words a question matches to pick the value), then the rest; inside each
class by the token's surprisal. It is query-agnostic (only the document's text) and meant as an
``ec --lift`` order: ``--lift literals --lift-share S --lift-level N`` stores the top ``S`` of the
kept tokens ``2**N`` times finer.
"""

from __future__ import annotations

import torch

from .sentences import SentencesScorer, sentence_bounds
from .rank import rank01

DIGIT, SENTENCE = 2.0, 1.0  # class scores; the surprisal rank (0 to 1) only orders tokens inside a class


def has_digit(text: str) -> bool:
    return any(c.isdigit() for c in text)


def literal_scores(surprisal: torch.Tensor, token_texts: list[str]) -> torch.Tensor:
    """``[T]`` per-token surprisal and texts -> ``[T]`` scores: ``DIGIT`` for a token holding a
    digit, ``SENTENCE`` for another token of a sentence with one, 0 else; plus the token's
    surprisal rank in ``[0, 1)`` (below 1, so a class never overtakes the one above it)."""
    s = surprisal.float().reshape(-1)
    if len(token_texts) != s.shape[0]:
        raise ValueError(f"{len(token_texts)} token texts for {s.shape[0]} surprisal values")
    digit = torch.tensor([has_digit(t) for t in token_texts], dtype=torch.bool)
    cls = torch.zeros(s.shape[0])
    for a, b in sentence_bounds(token_texts):
        if bool(digit[a:b].any()):
            cls[a:b] = SENTENCE
    cls[digit] = DIGIT
    return cls + 0.999 * rank01(s) if s.numel() else cls


class LiteralsScorer(SentencesScorer):
    """``literals``: tokens holding a digit first, then the rest of their sentences, then the
    others, each class by surprisal: the values an exact answer copies, an order for ``lift``
    (finer steps), not for eviction."""

    name = "literals"
    text_scores = staticmethod(literal_scores)
