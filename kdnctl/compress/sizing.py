"""The size budget: a document's stored K/V takes at most ``budget`` x its fp16 size.

``fp16 size`` = 2 bytes per element of K and V, all layers and KV heads. Everything stored for
the version counts against it: codes, scales, zeros, tier maps, positions, token ids and the
bundle headers (``compress`` checks the encoded bytes and tightens the plan if they overflow).

Planning a document (:func:`plan_tiers`):

1. the cheapest ladder tier for every kept row; if even that does not fit, the cap forces
   eviction and :func:`forced_keep` gives the token fraction the press keeps (eviction last);
2. every kept row's measured reconstruction error at every tier (``quant.ladder.tier_errors``)
   times its importance weight is its expected damage;
3. the solver (``allocate.tiers.solve_greedy``) picks one tier per row (key and value apart)
   minimising the damage under the bytes left.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..allocate.tiers import solve_greedy
from ..errors import UsageError
from ..scorers.rank import rank01
from ..quant.ladder import TIERS, LadderQuantizer, row_bytes, tier_errors

# --quant name -> the tiers the solver may use with a size budget (uniform ones have one tier)
LADDERS: dict[str, tuple[str, ...]] = {
    "floor": TIERS,  # the best single tier that holds every token, the bytes left lift rows one tier
    "uniform": TIERS,  # the best single tier that holds every token (see uniform_tier)
    "ladder": TIERS,
    "fp16": ("fp16",),
    "none": ("fp16",),
    "int8": ("int8",),
    "int4": ("int4",),
    "int3": ("int3",),
    "int2": ("int2",),
    "mixed": ("int8", "int4"),
}
# importance -> damage weight: rank r in [0, 1] per layer and head, weight r**SHARPNESS + FLOOR
SHARPNESS = 2.0
FLOOR = 0.05
KEY_WEIGHT = 1.0  # damage of a key row's error relative to a value row's (keys steer attention)
POSITION_BYTES = 2  # int16 positions per kept row pair (int32 beyond 32767)
HEADER_BYTES = 24_000  # first guess of one chunk's header + small tensors; corrected after encoding
CODING = "zlib+params"  # lossless coding of a size-budgeted version's codes and scales/zeros


def ladder_for(quant: str) -> tuple[str, ...]:
    try:
        return LADDERS[quant]
    except KeyError:
        raise UsageError(f"quantizer {quant!r} has no size-budgeted form",
                         hint=f"with --budget use one of {', '.join(LADDERS)}") from None


def may_evict(budget: float, quant: str, group_size: int, head_dim: int = 64) -> bool:
    """Whether a budget could force eviction at this ladder's cheapest tier (with a margin for
    headers and positions): if not, a single-tier recipe needs no importance scores."""
    lowest = ladder_for(quant)[-1]
    frac = row_bytes(lowest, head_dim, group_size, coded=CODING) / (2 * head_dim)
    return budget < frac * 1.15


def uniform_tier(avail: float, n_rows: int, head_dim: int, group: int) -> tuple[str, ...]:
    """The most precise single tier whose rows (K and V) all fit in ``avail`` bytes; the lowest
    (with forced eviction) if none does. Measured better than the importance-weighted ladder at
    0.25 (docs/compression.md)."""
    for t in TIERS:
        if n_rows * 2 * row_bytes(t, head_dim, group, coded=CODING) <= avail:
            return (t,)
    return (TIERS[-1],)


FLOOR_PROTECT = 64  # the auto recipe never evicts the last 64 tokens (nor the prompt header)
# below EC_FROM the forced tail is 32 tokens: at 64 the tail took a third of a 650-token document's
# kept third, and the room 32 leaves holds more of the asked facts
EVICT_PROTECT = 32
LOSSLESS_TIER = "int8"  # from where this tier holds every token, auto stores it (lossless); below, ec
EVICT_SCORER = "sentences-gap"  # below EC_FROM: whole sentences, ranked given the document and their window
EC_FROM = 0.25  # ec's per-token share: below it, the auto recipe evicts first
# below EC_FROM the kept share at the measured point: at 0.083 half of the tokens, steps 1.5x coarser
# than ec's at 0.25 (on the 130 tasks it kept more needles and a lower continuation NLL than a third
# of the tokens at 0.25's steps). Between it and EC_FROM (every token) the share is interpolated,
# below it proportional to the budget: measured at 0.083 only
EVICT_KEEP_AT = (0.083, 0.5)

# ec's auto lift: the top 30% of the kept tokens by `literals` (the digits, then their sentences) get
# keys 4x finer, the values keep their steps (format 1.10). The records' keys decide which of several
# alike facts a question reads (at 0.083: 20/40 facts against the unlifted kept set's 14/40)
AUTO_LIFT = {"lift": "literals", "lift_share": 0.3, "lift_level": 2, "lift_role": "keys"}
# below EC_FROM each token ranks by the better of `literals` and the eviction scorer (its ranks
# reused): the refit holds the lifted tokens' values, and a lift by digits alone left planted words
# to the fit (word answers at 0.083, tune half of realtext-words: 50/60 against 46/60, full 50/60)
EVICT_LIFT = {**AUTO_LIFT, "lift": f"literals+{EVICT_SCORER}"}

# below EC_FROM the kept tokens' values are refitted to the full attention of the document's own
# queries (kdnctl.compress.refit, ridge 0.01) and the lifted tokens' values are held (an unheld fit moves
# the planted answers). The fit reads the kept keys as the loader decodes them and the fitted values
# are rounded with feedback through the fit's normal matrix (kdnctl.compress.feedback). The measured
# table and how each choice was made: docs/compression.md and research/history-2026-11.md
AUTO_REFIT = 0.01


def evict_keep(budget: float) -> float:
    """The auto recipe's kept token share for a budget below EC_FROM (EVICT_KEEP_AT)."""
    b0, k0 = EVICT_KEEP_AT
    if budget <= b0:
        return round(k0 * budget / b0, 2)
    return round(k0 + (1 - k0) * (budget - b0) / (EC_FROM - b0), 2)


@dataclass(frozen=True)
class AutoRecipe:
    """What ``--quant auto`` resolves to for one budget (``scorer``/``ratio`` None: unchanged)."""

    quant: str
    keep: float = 1.0
    protect: int = 0
    scorer: str | None = None
    ratio: float | None = None  # KVCrush's share of representatives
    lift: dict | None = None  # ec's --lift, --lift-share, --lift-level, --lift-role (AUTO_LIFT)
    refit: float | None = None  # ec's --refit with --refit-hold, --refit-decoded, --refit-feedback where the recipe has a lift (AUTO_REFIT)


def auto_quant(budget: float, group: int, head_dim: int = 64) -> AutoRecipe:
    """``--quant auto`` (the default with a budget), from what was measured on the 130 real-text
    tasks (docs/compression.md has the table; research/history-2026-11.md how each choice was made):

    * from 0.25 to where int8 holds every token (~0.54): ``ec``, every token kept with
      attention-weighted, entropy-coded steps, the prompt header and the last 64 tokens finer,
      the keys of the top 30% of the tokens by ``literals`` 4x finer (AUTO_LIFT; option
      ``lift=none`` turns it off). At 0.25: 60/60 needles, 21/40 facts, continuation NLL 100.1%
      of the full cache's (full 60/60, 21/40);
    * below 0.25 (e.g. 0.083): ``ec`` with eviction first: ``evict_keep(budget)`` of the tokens
      kept, whole sentences ranked by the ``sentences-gap`` scorer (a planted fact in a list of
      alike facts is unsurprising given the document but not given its window), the prompt header
      and the last 32 tokens always kept, the keys of the top 30% of the kept tokens by the better
      rank of ``literals`` and that scorer 4x finer (EVICT_LIFT), the kept values refitted to the
      document's own queries with the lifted tokens' held (AUTO_REFIT; option ``refit=0`` turns it
      off). What 0.083 loses is mostly the evicted context: the same kept set at near-lossless
      steps answers about as few facts;
    * from ~0.54 ``uniform``: the most precise single tier that holds every token (int8,
      lossless on every check)."""
    frac = {t: 2 * row_bytes(t, head_dim, group, coded=CODING) / (4 * head_dim) for t in TIERS}
    best = next((t for t in TIERS if frac[t] * 1.02 <= budget), None)
    if best is not None and TIERS.index(best) <= TIERS.index(LOSSLESS_TIER):
        return AutoRecipe("uniform")
    if budget >= EC_FROM:
        return AutoRecipe("ec", 1.0, FLOOR_PROTECT, lift=AUTO_LIFT)
    return AutoRecipe("ec", evict_keep(budget), EVICT_PROTECT, EVICT_SCORER, lift=EVICT_LIFT, refit=AUTO_REFIT)


def floor_tiers(avail: float, n_rows: int, head_dim: int, group: int) -> tuple[str, ...]:
    """``uniform_tier`` and the tier above it: every row at least at the floor, the solver
    spends what is left on lifting the rows whose damage drops most per byte."""
    (t,) = uniform_tier(avail, n_rows, head_dim, group)
    i = TIERS.index(t)
    return TIERS[max(i - 1, 0):i + 1]


def fp16_bytes(n_tokens: int, n_layers: int, n_heads: int, head_dim: int) -> int:
    return 2 * 2 * n_tokens * n_layers * n_heads * head_dim


def weights(importance: torch.Tensor) -> torch.Tensor:
    """``[L, H, T]`` importance -> damage weights (rank-based, so any scorer's scale works)."""
    return rank01(importance) ** SHARPNESS + FLOOR


def forced_keep(avail: float, n_tokens: int, n_layers: int, n_heads: int, head_dim: int, group: int,
                lowest: str) -> float:
    """Largest token fraction whose rows all fit at the ``lowest`` tier in ``avail`` bytes."""
    per_token = n_layers * n_heads * (2 * row_bytes(lowest, head_dim, group, coded=CODING) + POSITION_BYTES)
    return max(0.0, min(1.0, avail / (n_tokens * per_token)))


def plan_tiers(q: LadderQuantizer, keys: list[torch.Tensor], values: list[torch.Tensor],
               positions: list[torch.Tensor], importance: list[torch.Tensor], tiers: tuple[str, ...],
               cap: float, errors: list[torch.Tensor] | None = None, key_weight: float = KEY_WEIGHT):
    """Tier maps for the kept rows: per layer (key tiers [H, T_i], value tiers [H, T_i]) as
    indices into ``ladder.TIERS``; None if even the cheapest tier exceeds ``cap`` bytes.

    ``keys/values[i]`` [H, T_i, D] are the kept rows, ``importance[i]`` [H, T_i] their weights,
    ``errors`` (optional, reused between calls) the output of ``tier_errors`` per layer."""
    d = keys[0].shape[-1]
    cost = torch.tensor([row_bytes(t, d, q.group_size, coded=q.coding) for t in tiers], dtype=torch.float64)
    if len(tiers) == 1:  # one tier: nothing to choose, no errors to measure
        if 2 * sum(k.shape[0] * k.shape[1] for k in keys) * float(cost[0]) > cap:
            return None, errors
        tid = TIERS.index(tiers[0])
        return [(torch.full(k.shape[:2], tid, dtype=torch.long),) * 2 for k in keys], errors
    if errors is None:
        errors = [tier_errors(q, k, v, p, list(tiers)) for k, v, p in zip(keys, values, positions)]
    role_w = torch.tensor([float(key_weight), 1.0])[:, None, None, None]
    dmg = torch.cat([(e * role_w * w[None, None]).permute(0, 2, 3, 1).reshape(-1, len(tiers))
                     for e, w in zip(errors, importance)])
    choice = solve_greedy(dmg, cost, cap)
    if choice is None:
        return None, errors
    ids = torch.tensor([TIERS.index(t) for t in tiers])[choice]
    out, o = [], 0
    for k in keys:
        h, t, _ = k.shape
        n = h * t
        kt = ids[o:o + n].view(h, t)
        vt = ids[o + n:o + 2 * n].view(h, t)
        out.append((kt, vt))
        o += 2 * n
    return out, errors


def mix(tier_maps: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, dict[str, int]]:
    """Rows per tier, keys and values apart (what ``show`` prints)."""
    res: dict[str, dict[str, int]] = {"keys": {}, "values": {}}
    for kt, vt in tier_maps:
        for role, m in (("keys", kt), ("values", vt)):
            for tid, name in enumerate(TIERS):
                n = int((m == tid).sum())
                if n:
                    res[role][name] = res[role].get(name, 0) + n
    return res
