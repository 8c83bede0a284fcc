"""KVCrush (Jha et al., 2025, "KVCrush: Key value cache size-reduction using similarity in
head-behaviour", arXiv 2503.00022).

Mechanism as in the paper:

1. The quota k of a layer is split into an importance part ``k_imp = k - k_rep`` and a
   representative part ``k_rep = round(ratio * k)`` (``ratio`` default 0.25).
2. Importance part: the top ``k_imp`` tokens per head by ``ctx.importance`` (any
   importance-based press's scores: the paper pairs KVCrush with H2O/SnapKV-style scorers).
   With ``page_size`` > 1 whole pages of consecutive tokens are ranked by their mean score
   (the paper's paged-KV variant); pages rarely add up to k exactly, so the first page that
   does not fit is filled by token score and the quota is met exactly.
3. Every token gets a binary head-behaviour vector: one bit per attention head, 1 when the
   token is in that head's top half of importance (score above the head's median).
4. The Hamming distance of every vector to an anchor vector (``anchor`` = "random" (seeded),
   "mean" (bit = 1 where at least half the tokens have it) or "alternate" (1010...)) is a
   one-dimensional proxy for grouping tokens by behaviour.
5. The tokens not already kept are sorted by that distance (stable, so by position within
   equal distances) and cut into ``k_rep`` equal buckets; the token at the centre of each
   bucket is kept as that bucket's representative. The representatives are thus evenly
   spaced over the sorted order and cover every behaviour group, which is what recovers the
   context the importance part alone drops.

Deviations, and why:

- GQA: the paper's vectors have one bit per attention head (32+ on the models it tests).
  Selection here is per KV head (the cache is per KV head), so ``bits="heads"`` (default)
  gives one bit per KV head of the layer: 3 bits on SmolLM2, i.e. only 4 possible
  distances, and the sort degenerates to 4 groups ordered by position. ``bits="layers"``
  uses the KV heads of ALL layers (L*H bits, 90 on SmolLM2) as one token-level vector shared
  by every layer, which restores a finer grouping. Neither choice is measured here.
- Representatives are chosen once per layer, but the paper keeps one token set per layer
  while we keep one per KV head. "Not already kept" therefore means "not kept by every head
  of the layer"; a representative that some head already keeps is replaced, for that head
  only, by the next candidate in sorted order that the head does not keep yet (wrapping to
  the start of the order if needed), so every head still keeps exactly k tokens.
- With ``page_size`` > 1 the behaviour vectors and distances are computed per page (from
  mean page scores) and shared by the page's tokens, but representatives are single tokens,
  which keeps the quota exact.
- Forced tokens (sinks, recent) count inside the importance part; if they exceed it, the
  representative part shrinks so the total stays k.

The bit, distance and packing work runs through ``kdnctl.kernels.kvcrush`` (Triton on CUDA,
torch elsewhere); nothing of it is re-implemented here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from kdnctl.errors import UsageError
from kdnctl.kernels.kvcrush import binarize, hamming, pack_bits
from kdnctl.presses.base import (
    Press,
    ScoreContext,
    mask_to_indices,
    round_half_up,
    sanitize,
    top_mask,
)

ANCHORS = ("random", "mean", "alternate")
BITS = ("heads", "layers")


@dataclass
class KVCrushPress(Press):
    name: ClassVar[str] = "kvcrush"
    uses_importance: ClassVar[bool] = True

    ratio: float = 0.25
    page_size: int = 1
    anchor: str = "random"
    bits: str = "heads"
    seed: int | None = None  # None: use the context's seed

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= float(self.ratio) <= 1.0:
            raise UsageError(f"kvcrush: ratio must be in [0, 1], got {self.ratio!r}")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1:
            raise UsageError(f"kvcrush: page_size must be a positive integer, got {self.page_size!r}")
        if self.anchor not in ANCHORS:
            raise UsageError(f"kvcrush: unknown anchor {self.anchor!r}", hint=f"one of {', '.join(ANCHORS)}")
        if self.bits not in BITS:
            raise UsageError(f"kvcrush: unknown bits {self.bits!r}", hint=f"one of {', '.join(BITS)}")

    def score(self, ctx: ScoreContext) -> Tensor:
        return sanitize(ctx.importance)

    # -- head behaviour -------------------------------------------------------------
    def anchor_bits(self, vectors: Tensor, seed: int) -> Tensor:
        """uint8 ``[G, n_bits]`` anchor per group from behaviour vectors ``[G, E, n_bits]``."""
        g, _, n = vectors.shape
        if self.anchor == "random":
            gen = torch.Generator().manual_seed(int(seed))
            return torch.randint(0, 2, (g, n), generator=gen, dtype=torch.uint8)
        if self.anchor == "mean":
            return (vectors.float().mean(dim=1) >= 0.5).to(torch.uint8)
        return (torch.arange(n) % 2 == 0).to(torch.uint8).expand(g, n).contiguous()

    def distances(self, entity_scores: Tensor, seed: int) -> Tensor:
        """int32 ``[L, E]`` Hamming distance of each entity's (token's or page's) behaviour
        vector to the anchor, from ``[L, H, E]`` scores."""
        l, h, e = entity_scores.shape
        # lower median: with distinct scores exactly floor(E/2) entities lie above it
        thresholds = entity_scores.median(dim=-1).values
        bits = binarize(entity_scores, thresholds)  # [L, H, E]
        if self.bits == "heads":
            vectors = bits.permute(0, 2, 1)  # one group per layer, H bits
        else:
            vectors = bits.permute(2, 0, 1).reshape(1, e, l * h)  # one group, L*H bits
        vectors = vectors.contiguous()
        anchor = pack_bits(self.anchor_bits(vectors, seed))
        dist = hamming(pack_bits(vectors), anchor)
        return dist.expand(l, e) if dist.shape[0] == 1 else dist

    # -- selection ------------------------------------------------------------------
    def split(self, k: int, n_forced: int) -> tuple[int, int]:
        """(k_imp, k_rep) of a quota; forced tokens live in the importance part."""
        k_rep = min(round_half_up(float(self.ratio) * k), k - n_forced)
        return k - k_rep, k_rep

    def select(self, ctx: ScoreContext, quotas: list[int], *, keep_sinks: bool = True,
               keep_recent: bool = True) -> list[Tensor]:
        ks = self.check_quotas(ctx, quotas)
        t, h = ctx.n_tokens, ctx.n_heads
        imp = sanitize(ctx.importance)
        p = self.page_size
        page_of = torch.arange(t) // p
        page_scores = page_means(imp, p)
        seed = ctx.seed if self.seed is None else int(self.seed)
        token_dist = None
        out = []
        for layer, k in enumerate(ks):
            forced = self.forced_indices(t, k, keep_sinks=keep_sinks, keep_recent=keep_recent)
            k_imp, k_rep = self.split(k, int(forced.numel()))
            kept = torch.zeros(h, t, dtype=torch.bool)
            kept[:, forced] = True
            kept |= page_top_mask(imp[layer], page_scores[layer], ~kept, k_imp - forced.numel(), p)
            if k_rep:
                if token_dist is None:  # computed once for all layers, only when needed
                    token_dist = self.distances(page_scores, seed)[:, page_of]
                kept |= representative_mask(token_dist[layer], kept, k_rep)
            out.append(mask_to_indices(kept, k))
        return out


def page_means(scores: Tensor, page_size: int) -> Tensor:
    """``[L, H, T]`` -> ``[L, H, ceil(T/page_size)]`` mean per page (last page may be short)."""
    if page_size == 1:
        return scores
    l, h, t = scores.shape
    page_of = torch.arange(t) // page_size
    n_pages = -(-t // page_size)
    sums = torch.zeros(l, h, n_pages).index_add_(2, page_of, scores)
    counts = torch.bincount(page_of, minlength=n_pages).clamp_min(1)
    return sanitize(sums / counts)  # +inf and -inf in one page make NaN: rank it last


def page_top_mask(tok_scores: Tensor, page_scores: Tensor, avail: Tensor, n: int, page_size: int) -> Tensor:
    """``[H, T]`` mask of n available tokens per head, taken as whole pages in page-score
    order while they fit, then the best tokens of the first page that does not fit."""
    if page_size == 1:
        return top_mask(tok_scores, avail, n)
    h, t = tok_scores.shape
    page_of = torch.arange(t) // page_size
    n_pages = page_scores.shape[-1]
    avail_len = torch.zeros(h, n_pages, dtype=torch.long).index_add_(1, page_of, avail.long())
    order = torch.sort(page_scores, dim=1, descending=True, stable=True).indices
    fits = avail_len.gather(1, order).cumsum(1) <= n
    page_full = torch.zeros(h, n_pages, dtype=torch.bool).scatter_(1, order, fits)
    mask = page_full[:, page_of] & avail
    remaining = n - mask.sum(dim=1)
    # the first page (in score order) that did not fit; irrelevant where remaining == 0
    partial = order.gather(1, (~fits).to(torch.int8).argmax(dim=1, keepdim=True))
    cand = avail & ~mask & (page_of.unsqueeze(0) == partial)
    return mask | top_mask(tok_scores, cand, remaining)


def representative_mask(dist: Tensor, kept: Tensor, k_rep: int) -> Tensor:
    """``[H, T]`` mask of k_rep representatives per head, none of them already in ``kept``.

    Candidates: tokens not kept by every head, sorted by distance (stable). Representative i
    is the candidate at the centre of bucket i of k_rep equal buckets; a head that already
    keeps it takes the next candidate it does not keep (greedy, in order, wrapping around).
    """
    h, t = kept.shape
    order = torch.sort(dist.to(torch.int64), stable=True).indices
    cand = order[~kept.all(dim=0)[order]]  # [M] token ids in sorted order
    m = cand.numel()
    i = torch.arange(k_rep)
    centre = ((2 * i + 1) * m) // (2 * k_rep)  # bucket centres: evenly spaced positions
    reps = torch.zeros(h, t, dtype=torch.bool)
    for head in range(h):
        free = torch.nonzero(~kept[head, cand]).flatten()  # positions in cand this head may take
        # first free position at or after each centre; then push collisions forward:
        # a_i = max(first_i, a_{i-1} + 1) == i + cummax(first_j - j)
        first = torch.searchsorted(free, centre)
        a = i + torch.cummax(first - i, dim=0).values
        over = a >= free.numel()
        if bool(over.any()):
            # ran off the end: wrap to the earliest free positions not taken yet
            used = torch.zeros(free.numel(), dtype=torch.bool)
            used[a[~over]] = True
            a[over] = torch.nonzero(~used).flatten()[: int(over.sum())]
        reps[head, cand[free[a]]] = True
    return reps
