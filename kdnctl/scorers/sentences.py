"""The ``sentences`` scorer: every token gets the mean surprisal of its sentence.

A question about a document asks for its information, and the model's own surprisal (-log p of
each token given the prefix, recorded at ingest) measures where the information is. Per token
it is a poor guide to what to keep: in a planted fact ("The maintenance access code for this
tool is 36964.") the topic words are in the top 1-3% of the document's surprisal but the digits
only around the 60th percentile, and a question needs both the words it matches and the value
it copies. Scored per sentence (a run of tokens ending at a newline or at ``.``/``?``/``!``),
the whole fact is kept or dropped together; the mean (not the sum) prefers short dense
sentences over long ordinary ones (``research/probes/lowbit_probe.py``, docs/compression.md).

The score is the same for every layer and KV head (a kept sentence is whole in every head);
ties inside a sentence break by the token's own surprisal.
"""

from __future__ import annotations

import torch

from ..models import adapter_for
from .base import Scorer, ScorerInput
from .rank import rank01

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


LOCAL_WINDOW = 64  # tokens of context before each sentence for the local surprisal
# sentences that share a forward row with the sentence starting it: a sentence reads 64 to 128
# tokens before it, and the forward costs ~2 tokens per document token instead of ~9 (sentences
# of man pages and prose average 4-10 tokens); research/probes/local_pack.py
LOCAL_PACK = 64
GAP_WEIGHT = 0.5  # sentences-gap: the share of (local - whole) added to the local surprisal


def local_rows(bounds: list[tuple[int, int]], window: int = LOCAL_WINDOW,
               pack: int | None = None) -> list[tuple[int, list[int]]]:
    """The rows of the local surprisal's forward: ``(first token, sentence indices)``. Each row
    starts ``window`` tokens before its first sentence; ``pack`` > 0 lets a row carry the
    sentences after its first while they end within ``pack`` tokens of its first sentence's
    start, so a later sentence of a row reads from ``window`` up to ``window + pack`` tokens
    before it, and the forward costs about ``(1 + window / pack)`` tokens per document token
    instead of ``(1 + window / sentence length)``. The first sentence of every row is scored
    exactly as in a row of its own. ``pack`` None: ``LOCAL_PACK``."""
    pack = LOCAL_PACK if pack is None else pack
    rows, i = [], 0
    while i < len(bounds):
        a = bounds[i][0]
        k = i + 1
        while pack > 0 and k < len(bounds) and bounds[k][1] - a <= pack:
            k += 1
        rows.append((max(0, a - window), list(range(i, k))))
        i = k
    return rows


def local_sentence_surprisal(lm, token_ids: list[int], bounds: list[tuple[int, int]], window: int = LOCAL_WINDOW,
                             batch_tokens: int = 8192, pack: int | None = None) -> torch.Tensor:
    """``[S]`` per sentence: the mean -log p of its tokens given only the ``window`` tokens before
    it, or up to ``pack`` more where it shares a forward row with the sentences before it
    (``local_rows``; one padded forward per batch of rows, logits only where a sentence token is
    predicted). A fact stated in a repeated template ("The locker code of the juniper group is
    9793.") is predictable given the whole document once the template has been seen, but not
    given its neighbourhood: this is the surprisal of a fact where it stands."""
    rows = local_rows(bounds, window, pack)
    ends = [bounds[r[1][-1]][1] for r in rows]
    out = torch.zeros(len(bounds))
    order = sorted(range(len(rows)), key=lambda r: ends[r] - rows[r][0])
    batch: list[int] = []

    decoder = adapter_for(lm.model).decoder

    def run(idx: list[int]) -> None:
        n = max(ends[r] - rows[r][0] for r in idx)
        x = torch.zeros(len(idx), n, dtype=torch.long)
        mask = torch.zeros(len(idx), n, dtype=torch.long)
        # which sentence each position's prediction (of the token after it) belongs to, -1: none
        owner = torch.full((len(idx), n), -1, dtype=torch.long)
        for i, r in enumerate(idx):
            c, sents = rows[r]
            b = ends[r]
            x[i, :b - c] = torch.tensor(token_ids[c:b])
            mask[i, :b - c] = 1
            for j in sents:
                sa, sb = bounds[j]
                owner[i, max(sa - c - 1, 0):sb - c - 1] = j
        scored = owner >= 0
        dev = lm.device
        with torch.inference_mode():
            hidden = decoder(input_ids=x.to(dev), attention_mask=mask.to(dev)).last_hidden_state
            sel = scored.to(dev)
            logits = lm.model.get_output_embeddings()(hidden[sel]).float()
            target = x.to(dev)[:, 1:][sel[:, :-1]] if n > 1 else x.new_zeros(0).to(dev)
            nll = (torch.logsumexp(logits, -1) - logits.gather(-1, target[:, None])[:, 0]).cpu()
        who = owner[scored]
        total = torch.zeros(len(bounds), dtype=nll.dtype).index_add_(0, who, nll)
        count = torch.zeros(len(bounds), dtype=nll.dtype).index_add_(0, who, torch.ones_like(nll))
        for r in idx:
            for j in rows[r][1]:
                out[j] = total[j] / count[j] if count[j] > 0 else 0.0

    for r in order:
        c = rows[r][0]
        if batch and (len(batch) + 1) * (ends[r] - c) > batch_tokens:
            run(batch)
            batch = []
        batch.append(r)
    if batch:
        run(batch)
    return out


def local_sentence_scores(lm, surprisal: torch.Tensor, token_ids: list[int], window: int = LOCAL_WINDOW,
                          gap_weight: float = 0.0) -> torch.Tensor:
    """``[T]`` scores of the ``sentences-local`` scorer: per sentence the better of two ranks (in
    [0, 1] over the document's sentences), its mean surprisal given the whole document (as
    ``sentences``: a needle that does not belong where it stands) and given only the ``window``
    to ``window + LOCAL_PACK`` tokens before it (``local_sentence_surprisal``: facts in a repeated
    template); ties break by the token's own surprisal as in ``sentence_surprisal``.

    ``gap_weight`` (``GAP_WEIGHT`` for the ``sentences-gap`` scorer) adds that much of the gap
    between the two surprisals (local minus whole: how much the document beyond the window
    predicts the sentence) to the local one before ranking. A sentence in a form the document
    set up earlier (a record of a table or list: "The port for the marlin service is 8784."
    after three others) has a large gap, while ordinary prose is about as predictable from its
    window as from the whole document; ranked by the local surprisal alone, the kept sentences
    go to prose that is hard anywhere and the later records of a template fall just below the
    cut (docs/compression.md, "Records in a template")."""
    bounds = sentence_bounds(token_texts(lm.tokenizer, token_ids))
    local = local_sentence_surprisal(lm, token_ids, bounds, window)
    return two_rank_scores(surprisal, bounds, local, gap_weight)


def two_rank_scores(surprisal: torch.Tensor, bounds: list[tuple[int, int]], local: torch.Tensor,
                    gap_weight: float = 0.0) -> torch.Tensor:
    """``[T]`` scores from per-token ``surprisal`` (given the whole document) and each sentence's
    ``local`` surprisal: per sentence the better of the ranks of its whole-document mean and of
    ``local + gap_weight x (local - whole)``; ties break by the token's own surprisal. The model-
    free half of ``local_sentence_scores`` (``research/probes/sentence_gap_probe.py`` reuses it on dumps)."""
    s = surprisal.float().reshape(-1)
    t = s.shape[0]
    whole = torch.tensor([float(s[a:b].mean()) for a, b in bounds])
    local = local.float()
    best = torch.maximum(rank01(whole), rank01(local + gap_weight * (local - whole)))
    out = torch.zeros(t)
    for (a, b), v in zip(bounds, best.tolist()):
        out[a:b] = v
    if t > 1:
        out += 1e-3 * s.argsort().argsort().float() / (t - 1)
    return out



class SentencesScorer(Scorer):
    """``sentences``: every token scores the mean surprisal of its sentence; a planted fact is
    kept whole, its value with the words a question matches."""

    name = "sentences"
    stats = ("surprisal",)
    needs_model = True
    needs = "the tokenizer (sentence bounds)"

    def score(self, inputs: ScorerInput) -> torch.Tensor:
        texts = token_texts(inputs.lm.tokenizer, inputs.token_ids)
        return inputs.per_token(self.text_scores(inputs.stats["surprisal"], texts))

    @staticmethod
    def text_scores(surprisal: torch.Tensor, texts: list[str]) -> torch.Tensor:
        """``[T]`` scores from the surprisal and the tokens' texts."""
        return sentence_surprisal(surprisal, texts)


class LocalSentencesScorer(Scorer):
    """``sentences-local``: per sentence the better of two ranks, its mean surprisal given the
    whole document and given only the ``LOCAL_WINDOW`` to ``LOCAL_WINDOW + LOCAL_PACK`` tokens
    before it (one extra batched forward of ~2 tokens per document token): facts stated in a
    repeated template are predictable given the document, not where they stand."""

    name = "sentences-local"
    stats = ("surprisal",)
    needs_model = True
    gap_weight: float = 0.0

    def score(self, inputs: ScorerInput) -> torch.Tensor:
        return inputs.per_token(local_sentence_scores(inputs.lm, inputs.stats["surprisal"], list(inputs.token_ids),
                                                      gap_weight=self.gap_weight))


class GapSentencesScorer(LocalSentencesScorer):
    """``sentences-gap``: as ``sentences-local``, the local surprisal ranked with ``GAP_WEIGHT``
    of the gap between the two surprisals added: large for a record in a template the document
    set up earlier (a table row), small for prose."""

    name = "sentences-gap"
    gap_weight = GAP_WEIGHT
