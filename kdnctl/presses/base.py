"""Shared plumbing of every press: the score context, quota arithmetic and the default
"forced tokens + top-k of the score" selection.

A press decides, per layer and per KV head, which token positions of a document survive.
Every head of a layer keeps the same number of tokens because the transformers cache stores
one tensor per layer with equal lengths across heads. Results are per layer int64
``[H, k_l]`` index tensors, sorted ascending within each head.

Ties are broken by position (earlier first) via stable sorts, so selections are
deterministic for a given input; NaN scores never win (treated as -inf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from kdnctl.errors import UnsupportedError, UsageError


# --------------------------------------------------------------------------- context


@dataclass
class ScoreContext:
    """Everything a press may look at for one document (or one chunk of it).

    ``importance``: ``[L, H, T]`` scores of the scorer the user chose (higher = keep).
    ``keys`` / ``values``: per layer ``[H, T, D]`` (keys post-RoPE), or None.
    ``stats``: optional ``window`` ``[L, H, T]`` (observation-window attention), ``accum``
    ``[L, H, T]`` (accumulated attention), ``surprisal`` ``[T]``.
    ``n_tokens``: T; inferred from ``importance`` when None.
    ``seed``: seeds every random choice (random press, random KVCrush anchor).
    ``offset``: absolute position of token 0 of this context in its document (non-zero for
    chunk contexts made by :meth:`slice`); lets seeded presses draw per-position values that
    do not depend on how the document was chunked.
    """

    importance: Tensor
    keys: list[Tensor] | None = None
    values: list[Tensor] | None = None
    stats: dict[str, Tensor] = field(default_factory=dict)
    n_tokens: int | None = None
    seed: int = 0
    offset: int = 0

    def __post_init__(self) -> None:
        if self.importance.dim() != 3:
            raise ValueError(f"importance must be [L, H, T], got {tuple(self.importance.shape)}")
        t = self.importance.shape[-1]
        if self.n_tokens is None:
            self.n_tokens = t
        elif self.n_tokens != t:
            raise ValueError(f"n_tokens={self.n_tokens} but importance has T={t}")

    @property
    def n_layers(self) -> int:
        return self.importance.shape[0]

    @property
    def n_heads(self) -> int:
        return self.importance.shape[1]

    def stat(self, name: str, press: str) -> Tensor:
        """A ``[L, H, T]`` statistic as float32; a clear error when ingest did not record it."""
        if name not in self.stats or self.stats[name] is None:
            raise UnsupportedError(
                f"press '{press}' needs the '{name}' statistic, which this bundle does not have",
                hint="re-ingest the document (statistics are recorded at ingest) or pick "
                "another press",
            )
        return self.stats[name].float()

    def slice(self, start: int, end: int) -> "ScoreContext":
        """The context restricted to tokens ``[start, end)`` (chunk-local indices from 0)."""

        def cut_layers(xs: list[Tensor] | None) -> list[Tensor] | None:
            return None if xs is None else [x[:, start:end] for x in xs]

        stats = {}
        for name, x in self.stats.items():
            # per-token stats are [T]; per-head stats are [L, H, T]: the token axis is last.
            stats[name] = None if x is None else x[..., start:end]
        return ScoreContext(
            importance=self.importance[..., start:end],
            keys=cut_layers(self.keys),
            values=cut_layers(self.values),
            stats=stats,
            n_tokens=end - start,
            seed=self.seed,
            offset=self.offset + start,
        )


# --------------------------------------------------------------------------- helpers


def round_half_up(x: float) -> int:
    """Python's round() rounds half to even (round(2.5) == 2); quotas round half up."""
    return int(math.floor(x + 0.5))


def validate_budget(budget: Any) -> float:
    """The fraction of tokens to keep must be a number in (0, 1]."""
    try:
        value = float(budget)
    except (TypeError, ValueError):
        raise UsageError(
            f"budget must be a number, got {budget!r}",
            hint="the budget is the fraction of tokens to keep, in (0, 1], e.g. 0.25", param="budget",
        ) from None
    if isinstance(budget, bool) or math.isnan(value) or not 0.0 < value <= 1.0:
        raise UsageError(
            f"budget must be in (0, 1], got {budget!r}",
            hint="the budget is the fraction of tokens to keep, in (0, 1], e.g. 0.25", param="budget",
        )
    return value


def sanitize(scores: Tensor) -> Tensor:
    """float32 copy with NaN -> -inf so a NaN score never wins a top-k."""
    s = scores.float()
    return torch.where(torch.isnan(s), torch.full_like(s, -math.inf), s)


def top_mask(scores: Tensor, cand: Tensor, n: Tensor | int) -> Tensor:
    """Boolean ``[H, T]`` mask of the ``n[h]`` highest-scoring candidates per row.

    Two stable sorts make the candidate flag the primary key and the score the secondary one,
    so a candidate with score -inf still beats a non-candidate, and equal scores keep the
    earlier position. ``n`` may differ per row; it must not exceed the candidate count.
    """
    h, t = scores.shape
    if not torch.is_tensor(n):
        n = torch.full((h,), int(n), dtype=torch.long)
    o1 = torch.sort(sanitize(scores), dim=1, descending=True, stable=True).indices
    c1 = cand.gather(1, o1).to(torch.int8)
    o2 = torch.sort(c1, dim=1, descending=True, stable=True).indices
    order = o1.gather(1, o2)
    take = torch.arange(t).unsqueeze(0) < n.to(torch.long).unsqueeze(1)
    if bool((take & ~cand.gather(1, order)).any()):
        raise ValueError("top_mask asked for more tokens than there are candidates")
    return torch.zeros(h, t, dtype=torch.bool).scatter_(1, order, take)


def mask_to_indices(mask: Tensor, k: int) -> Tensor:
    """``[H, T]`` mask with exactly k True per row -> int64 ``[H, k]`` ascending."""
    h, t = mask.shape
    counts = mask.sum(dim=1)
    if bool((counts != k).any()):
        raise AssertionError(f"selection kept {counts.tolist()} tokens per head, expected {k}")
    return torch.arange(t).expand(h, t)[mask].reshape(h, k).contiguous()


# --------------------------------------------------------------------------- press


@dataclass
class Press:
    """Base of every press. Subclasses implement :meth:`score` (higher = keep) and may
    override :meth:`select` when the rule is not "top-k of a score".

    ``sink_tokens``: the first tokens of the document (attention sinks), kept unconditionally.
    ``recent_tokens``: the last tokens of the document, kept unconditionally.
    Both are counted INSIDE the per-layer quota; when the quota is smaller than the forced
    set, sinks win over recent tokens and earlier sinks over later ones.
    """

    name: ClassVar[str] = "base"
    # True when the press ranks by ``ctx.importance`` (the user's --scorer); presses with their
    # own statistic (snapkv: window, h2o: accum, ...) skip the scorer and its model passes.
    uses_importance: ClassVar[bool] = False

    sink_tokens: int = 4
    recent_tokens: int = 0

    def __post_init__(self) -> None:
        for f in ("sink_tokens", "recent_tokens"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise UsageError(f"{self.name}: {f} must be a non-negative integer, got {v!r}")

    # -- subclass hooks -------------------------------------------------------------
    def score(self, ctx: ScoreContext) -> Tensor:
        raise NotImplementedError

    def recent_count(self, k: int) -> int:
        """How many trailing tokens are forced for a quota k (H2O makes this depend on k)."""
        return self.recent_tokens

    # -- quotas ---------------------------------------------------------------------
    def quotas_for_budget(self, budget: float, n_tokens: int, n_layers: int) -> list[int]:
        """Uniform per-layer quota: round(budget*T), at least the sinks (and 1), at most T."""
        b = validate_budget(budget)
        if n_tokens <= 0:
            return [0] * n_layers
        k = max(round_half_up(b * n_tokens), self.sink_tokens, 1)
        return [min(k, n_tokens)] * n_layers

    def check_quotas(self, ctx: ScoreContext, quotas: list[int]) -> list[int]:
        if len(quotas) != ctx.n_layers:
            raise ValueError(f"{len(quotas)} quotas for {ctx.n_layers} layers")
        out = []
        for q in quotas:
            if int(q) != q or q < 0:
                raise ValueError(f"quotas must be non-negative integers, got {q!r}")
            out.append(min(int(q), ctx.n_tokens))
        return out

    # -- selection ------------------------------------------------------------------
    def forced_indices(
        self, n_tokens: int, k: int, *, keep_sinks: bool = True, keep_recent: bool = True
    ) -> Tensor:
        """Positions kept unconditionally, in priority order, at most k of them."""
        order: list[int] = []
        if keep_sinks:
            order.extend(range(min(self.sink_tokens, n_tokens)))
        if keep_recent:
            r = min(self.recent_count(k), n_tokens)
            order.extend(range(n_tokens - 1, n_tokens - 1 - r, -1))
        seen: set[int] = set()
        uniq = [i for i in order if not (i in seen or seen.add(i))]
        return torch.tensor(uniq[:k], dtype=torch.long)

    def select(self, ctx: ScoreContext, quotas: list[int], *, keep_sinks: bool = True,
               keep_recent: bool = True) -> list[Tensor]:
        """Per layer ``[H, k_l]`` kept indices: forced tokens, then the top of :meth:`score`.

        ``keep_sinks`` / ``keep_recent`` switch the forced sets off for chunks that are not
        the first / last of their document (see :mod:`kdnctl.presses.document`).
        """
        ks = self.check_quotas(ctx, quotas)
        scores = self.score(ctx)
        t = ctx.n_tokens
        out = []
        for layer, k in enumerate(ks):
            forced = self.forced_indices(t, k, keep_sinks=keep_sinks, keep_recent=keep_recent)
            out.append(select_top(scores[layer], k, forced))
        return out


def select_top(scores: Tensor, k: int, forced: Tensor) -> Tensor:
    """``[H, T]`` scores -> ``[H, k]``: the forced positions plus the best of the rest."""
    h, t = scores.shape
    forced_mask = torch.zeros(t, dtype=torch.bool)
    forced_mask[forced] = True
    cand = (~forced_mask).expand(h, t)
    mask = top_mask(scores, cand, k - int(forced.numel())) | forced_mask
    return mask_to_indices(mask, k)
