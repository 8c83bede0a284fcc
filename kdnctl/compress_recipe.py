"""A ``kdnctl compress`` recipe: what to keep and how to store it, resolved once (``--quant auto``
picks the method for the budget here), its catalog record (``as_dict``) and its default label."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

from . import sizing
from .allocate import ALLOCATORS, DEFAULT_ALLOCATOR, Allocator, get_allocator
from .errors import UsageError
from .presses import get_press, press_class
from .presses.base import Press, validate_budget
from .quant.base import DEFAULT_GROUP_SIZE
from .quant.entropy import MAX_LEVEL
from .registry import method_fields
from .scoring import DEFAULT_SCORER, NEEDS_MODEL, SCORERS

# Old spellings of the per-layer allocators, once presses wrapping a press ("pyramid:kvcrush", ...).
_LEGACY_WRAPPED = {"pyramid": "snapkv", "adaptive": "kvcrush"}
# --backfill: the evicted tokens' steps are 2**shift x the kept tokens' (the first version's 3 is the
# default so its recipes and labels still match; bench/ec_bits.py measures what each shift stores)
BACKFILL_SHIFT = 3
KEY_BASES = ("auto", "model", "none")
MAX_BACKFILL_SHIFT = 4  # the protected tokens sit 2 levels up and ec's finest level is 6
PROTECT_LEVEL = 2  # ec: header and forced tail 2**level finer; the default and the most (see MAX_BACKFILL_SHIFT)
LIFT_SHARE, LIFT_LEVEL = 0.25, 1  # ec --lift SCORER: the top quarter of the kept tokens by it, 2x finer steps
# the lifted tokens may sit above the header's level: an exact value's digits need keys much finer
# than the rest (bench/precision_probe.py); with --backfill the shift on top must stay within MAX_LEVEL
MAX_LIFT_LEVEL = MAX_LEVEL - PROTECT_LEVEL


@dataclass
class CompressRecipe:
    """``budget``: size cap as a fraction of the fp16 K/V bytes (None: no cap, pure eviction);
    ``keep``: fraction of tokens kept per layer and KV head by ``method``; ``quant``: with a
    budget, the tiers (``auto``/None = ``sizing.auto_quant``, ``uniform`` = best single tier that
    fits, ``floor`` = that tier + one-tier upgrades, ``ladder`` = per-token tiers, ``int4`` = int4,
    ``fp16`` = eviction alone); without one, the quantizer of every kept token."""

    budget: float | None = 0.25
    method: str = "kvcrush"
    scorer: str | None = None  # None: DEFAULT_SCORER, or what ``--quant auto`` chose for the budget
    quant: str | None = None
    group_size: int = DEFAULT_GROUP_SIZE
    seed: int = 0
    method_options: dict[str, Any] = field(default_factory=dict)
    allocator: str = DEFAULT_ALLOCATOR
    allocator_options: dict[str, Any] = field(default_factory=dict)
    keep: float = 1.0
    coding: str = sizing.CODING  # size budget: lossless coding of codes (+ scales/zeros)
    protect: int = 0  # size budget: the last N tokens (and the prompt header) are never evicted and lifted first
    lift: str | None = None  # size budget: a second scorer whose top tokens are also lifted first (ec: finer steps)
    key_weight: float = sizing.KEY_WEIGHT  # size budget: a key row's damage relative to a value row's (solver)
    layers: str | None = None  # ec: "fisher" (steps per layer and role scaled by a Fisher estimate of their damage) | "even"
    backfill: str | None = None  # ec with --keep: "A-B", layers where the evicted tokens are kept too, at coarse steps
    backfill_shift: int = BACKFILL_SHIFT  # their steps: 2**backfill_shift x the kept tokens'
    backfill_key_shift: int | None = None  # the keys' own shift (0 to MAX): None = backfill_shift
    # ec: keys in the model's registered principal axes (kdnctl.quant.basis): "auto" where the
    # model has a basis (unrecorded, like the frames' coder: versions made before keep their
    # recipe and label), "model" (required), "none" (channels, as before format 1.7)
    key_basis: str = "auto"
    # ec with --keep: the kept tokens' values refitted so that the document's own queries, placed
    # after it, read the full cache's attention output (kdnctl.value_refit); the ridge weight,
    # None or 0 = off (measured at 0.083: continuation NLL better, needles and facts worse)
    refit: float | None = None
    # with --refit and --lift: the lifted tokens' values stay as they are (the fit moves the rest)
    refit_hold: bool = False
    # with --refit: fit the values to the kept keys as the loader decodes them (quantized at a first
    # fit of the budget's scale), not to the keys before quantization
    refit_decoded: bool = False
    # with --refit: the refitted values rounded to ec's grid token by token, each rounding error
    # carried into the chunk's later tokens through the fit's normal matrix (kdnctl.value_feedback)
    refit_feedback: bool = False
    # ec: the prompt header and the last ``protect`` tokens get steps 2**level finer; None = the
    # default (PROTECT_LEVEL, 4x), 0 keeps them but spends no extra bits on them
    protect_level: int | None = None
    # ec with --keep: the share of the kept tokens (beyond header and tail) chosen by what the
    # document's last queries read (kdnctl.tail_reads), the rest by the scorer; None or 0 = off
    tail_reads: float | None = None
    # ec with --lift: the share of the kept tokens it lifts (None = LIFT_SHARE) and how many levels
    # (2**level finer steps, 1 to MAX_LIFT_LEVEL; None = LIFT_LEVEL), and which role: None both,
    # "keys" the keys alone (the values keep the unlifted levels; format 1.10's token_levels.keys)
    lift_share: float | None = None
    lift_level: int | None = None
    lift_role: str | None = None

    def __post_init__(self) -> None:
        self.keep = validate_budget(self.keep)
        if not isinstance(self.protect, int) or isinstance(self.protect, bool) or self.protect < 0:
            raise UsageError(f"protect must be a whole number of tokens >= 0, got {self.protect!r}", param="protect")
        if isinstance(self.key_weight, bool) or not isinstance(self.key_weight, (int, float)) or not self.key_weight > 0:
            raise UsageError(f"key_weight must be a number > 0, got {self.key_weight!r}", param="key_weight")
        self.key_weight = float(self.key_weight)
        no_lift = self.lift == "none"  # opts out of the auto recipe's lift
        if no_lift:
            self.lift = None
        if self.lift is not None and self.lift not in SCORERS:
            raise UsageError(f"unknown scorer {self.lift!r} to lift by", hint=f"choose one of {', '.join(SCORERS)}", param="lift")
        if self.coding not in ("zlib", "zlib+params"):
            raise UsageError(f"unknown coding {self.coding!r}", hint="zlib or zlib+params", param="coding")
        if self.budget is not None:
            self.budget = validate_budget(self.budget)
            if self.quant in (None, "auto"):
                auto = sizing.auto_quant(self.budget, self.group_size)
                self.quant, self.keep, self.protect = auto.quant, min(self.keep, auto.keep), max(self.protect, auto.protect)
                if self.scorer is None and auto.scorer is not None:
                    self.scorer = auto.scorer
                # a --lift-share etc. of the user's stays; with --backfill the wide rows share the cap and the
                # auto lift cost facts there (docs/compression.md, session 35): the user chooses a lift
                if auto.lift and self.lift is None and not no_lift and self.backfill is None:
                    for name, value in auto.lift.items():
                        if getattr(self, name) is None:
                            setattr(self, name, value)
                # the auto refit holds the lifted tokens' values, so it comes with a lift (the auto one or
                # the user's); --refit 0 turns it off, a --refit RHO of the user's stands as given
                if auto.refit and self.refit is None and self.lift and self.backfill is None and self.keep < 1:
                    self.refit, self.refit_hold = auto.refit, True
                    self.refit_decoded = self.refit_feedback = True  # session 40: fitted to the keys as decoded, rounded with feedback
                # the sentences scorer is the same in every head: KVCrush's head-behaviour
                # representatives would be arbitrary, so the auto recipe keeps by importance alone
                if auto.ratio is not None and self.scorer == auto.scorer and str(self.method).partition(":")[0] == "kvcrush":
                    self.method_options = {"ratio": auto.ratio, **self.method_options}
            if self.quant != "ec": sizing.ladder_for(self.quant)  # noqa: E701 (an unknown --quant is refused here)
        elif self.quant is None:
            self.quant = "none"
        elif self.quant == "ec":
            raise UsageError("--quant ec fits its steps to a byte cap", hint="add --budget B", param="quant")
        if self.scorer is None:
            self.scorer = DEFAULT_SCORER
        self.layers = self.layers or self.auto_layers  # after auto: it depends on keep
        if self.layers not in ("fisher", "even"):
            raise UsageError(f"unknown layer split {self.layers!r}", hint="fisher or even", param="layers")
        if self.backfill is not None:
            heads = self.backfill_heads  # parses: a bad spec is refused here
            if any(h is not None for h in heads.values()):  # one spelling per set of heads (recipe and label)
                self.backfill = "+".join(f"{i}" if h is None else "+".join(f"{i}.{x}" for x in h) for i, h in heads.items())
            if not (self.sized and self.quant == "ec" and self.keep < 1 and self.layers == "even"):
                raise UsageError("--backfill keeps the tokens ec's --keep evicts, coarsely, in some layers",
                                 hint="use it with --budget B --quant ec --keep K (even layer split)", param="backfill")
        shift = self.backfill_shift
        if isinstance(shift, bool) or not isinstance(shift, int) or not 0 <= shift <= MAX_BACKFILL_SHIFT:
            raise UsageError(f"backfill_shift must be a whole number from 0 to {MAX_BACKFILL_SHIFT}, got {shift!r}",
                             hint="2**shift is how much coarser the backfilled tokens' steps are", param="backfill_shift")
        if shift != BACKFILL_SHIFT and self.backfill is None:
            raise UsageError("--backfill-shift sets how coarse --backfill's tokens are", hint="add --backfill A-B",
                             param="backfill_shift")
        ks = self.backfill_key_shift
        if ks is not None:
            if isinstance(ks, bool) or not isinstance(ks, int) or not 0 <= ks <= MAX_BACKFILL_SHIFT:
                raise UsageError(f"backfill_key_shift must be a whole number from 0 to {MAX_BACKFILL_SHIFT}, got {ks!r}",
                                 hint="2**shift is how much coarser the backfilled tokens' keys are",
                                 param="backfill_key_shift")
            if self.backfill is None:
                raise UsageError("--backfill-key-shift sets how coarse --backfill's keys are", hint="add --backfill A-B",
                                 param="backfill_key_shift")
        if self.key_basis not in KEY_BASES:
            raise UsageError(f"unknown key basis {self.key_basis!r}", hint=" or ".join(KEY_BASES), param="key_basis")
        if self.key_basis != "auto" and not (self.sized and self.quant == "ec"):
            raise UsageError("--key-basis rotates the keys of the entropy-coded ec layout",
                             hint="use it with --budget B --quant ec", param="key_basis")
        if self.refit is not None:
            if isinstance(self.refit, bool) or not isinstance(self.refit, (int, float)) or not self.refit >= 0:
                raise UsageError(f"refit must be a ridge weight >= 0 (0: off), got {self.refit!r}", param="refit")
            self.refit = float(self.refit) or None
        if self.refit and not (self.sized and self.quant == "ec" and self.keep < 1 and self.backfill is None):
            raise UsageError("--refit refits the values of the tokens ec's --keep keeps",
                             hint="use it with --budget B --quant ec --keep K (no --backfill), or --refit 0", param="refit")
        if not isinstance(self.refit_hold, bool):
            raise UsageError(f"refit_hold must be true or false, got {self.refit_hold!r}", param="refit_hold")
        if self.refit_hold and not (self.refit and self.lift):
            raise UsageError("--refit-hold keeps the tokens --lift lifts out of --refit's fit",
                             hint="add --refit RHO (e.g. 0.01) and keep a --lift (the auto recipe has one)", param="refit_hold")
        for name in ("refit_decoded", "refit_feedback"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name} must be true or false, got {getattr(self, name)!r}", param=name)
            if getattr(self, name) and not self.refit:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} goes with --refit's value fit", hint=f"add --refit RHO (e.g. 0.01), or drop {flag}",
                                 param=name)
        tr = self.tail_reads
        if tr is not None:
            if isinstance(tr, bool) or not isinstance(tr, (int, float)) or not 0 <= tr < 1:
                raise UsageError(f"tail_reads must be a share from 0 to below 1 (0: off), got {tr!r}",
                                 hint="e.g. 0.25", param="tail_reads")
            self.tail_reads = float(tr) or None
        if self.tail_reads and not (self.sized and self.quant == "ec" and self.keep < 1):
            raise UsageError("--tail-reads chooses part of the tokens ec's --keep keeps",
                             hint="use it with --budget B --quant ec --keep K, or --tail-reads 0", param="tail_reads")
        pl = self.protect_level
        if pl is not None:
            if isinstance(pl, bool) or not isinstance(pl, int) or not 0 <= pl <= PROTECT_LEVEL:
                raise UsageError(f"protect_level must be a whole number from 0 to {PROTECT_LEVEL}, got {pl!r}",
                                 hint="2**level is how much finer the header's and the forced tail's steps are",
                                 param="protect_level")
            if not (self.sized and self.quant == "ec"):
                raise UsageError("--protect-level sets how fine ec stores the header and the forced tail",
                                 hint="use it with --budget B --quant ec", param="protect_level")
        self._check_lift_steps()
        wrapper, _, inner = str(self.method).partition(":")
        if wrapper in _LEGACY_WRAPPED:
            opts = dict(self.method_options)
            inner = inner or opts.pop("press", None) or _LEGACY_WRAPPED[wrapper]
            press_opts = opts.pop("press_options", {})
            own = method_fields(ALLOCATORS[wrapper])
            self.allocator, self.method = wrapper, str(inner)
            self.allocator_options = {**{k: v for k, v in opts.items() if k in own}, **self.allocator_options}
            self.method_options = {**{k: v for k, v in opts.items() if k not in own}, **press_opts}

    def _check_lift_steps(self) -> None:
        share, level = self.lift_share, self.lift_level
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise UsageError(f"lift_share must be a share above 0 and at most 1, got {share!r}",
                             hint="e.g. 0.05: the top 5% of the kept tokens by --lift", param="lift_share")
        if level is not None and (isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= MAX_LIFT_LEVEL):
            raise UsageError(f"lift_level must be a whole number from 1 to {MAX_LIFT_LEVEL}, got {level!r}",
                             hint="2**level is how much finer the lifted tokens' steps are", param="lift_level")
        if level is not None and self.backfill is not None and level + max(self.backfill_shifts) > MAX_LEVEL:
            raise UsageError(f"lift_level {level} plus the backfill shift {max(self.backfill_shifts)} passes ec's "
                             f"finest level ({MAX_LEVEL})", hint="lower --lift-level or --backfill-shift",
                             param="lift_level")
        if self.lift_role not in (None, "keys"):
            raise UsageError(f"lift_role must be keys (or unset: both roles), got {self.lift_role!r}",
                             hint="--lift-role keys lifts the keys alone", param="lift_role")
        if (share is not None or level is not None or self.lift_role) and not (self.lift and self.sized and self.quant == "ec"):
            raise UsageError("--lift-share, --lift-level and --lift-role set how ec lifts the top tokens of --lift",
                             hint="use them with --budget B --quant ec --lift SCORER", param="lift_share")
        self.lift_share = None if share is None else float(share)

    @property
    def lift_steps(self) -> tuple[float, int]:
        """ec --lift: (share of the kept tokens lifted, levels they go up)."""
        return (LIFT_SHARE if self.lift_share is None else self.lift_share,
                LIFT_LEVEL if self.lift_level is None else self.lift_level)

    def as_dict(self) -> dict:
        d = {"step": "compress", "budget": self.budget, "keep": self.keep, "method": self.method, "scorer": self.scorer,
             "quant": self.quant, "group_size": self.group_size, "seed": self.seed,
             "method_options": dict(sorted(self.method_options.items()))}
        if self.sized and self.coding != "zlib" and self.quant != "ec" and sizing.ladder_for(self.quant) != ("fp16",):
            d["coding"] = self.coding  # versions made before params were coded ("zlib") match
        if self.protect:
            d["protect"] = self.protect
        if self.lift:
            d["lift"] = self.lift
        if self.lift_share is not None:
            d["lift_share"] = self.lift_share
        if self.lift_level is not None:
            d["lift_level"] = self.lift_level
        if self.lift_role is not None:
            d["lift_role"] = self.lift_role
        if self.key_weight != sizing.KEY_WEIGHT:
            d["key_weight"] = self.key_weight
        if self.quant == "ec": d["layers"] = self.layers  # noqa: E701 (absent: the even split of older versions)
        if self.backfill:
            d["backfill"] = self.backfill
        if self.backfill_shift != BACKFILL_SHIFT:
            d["backfill_shift"] = self.backfill_shift
        if self.backfill_key_shift is not None:
            d["backfill_key_shift"] = self.backfill_key_shift
        if self.key_basis != "auto":
            d["key_basis"] = self.key_basis
        if self.refit:
            d["refit"] = self.refit
        if self.refit_hold:
            d["refit_hold"] = True
        if self.refit_decoded:
            d["refit_decoded"] = True
        if self.refit_feedback:
            d["refit_feedback"] = True
        if self.protect_level is not None:
            d["protect_level"] = self.protect_level
        if self.tail_reads:
            d["tail_reads"] = self.tail_reads
        if self.allocator != DEFAULT_ALLOCATOR:  # absent = uniform: versions made before allocators match
            d.update(allocator=self.allocator, allocator_options=dict(sorted(self.allocator_options.items())))
        return d

    @property
    def backfill_layers(self) -> tuple[int, ...]:
        """The layers ``backfill`` names, ascending; empty without one (:attr:`backfill_heads`)."""
        return tuple(sorted(self.backfill_heads))

    @property
    def backfill_heads(self) -> dict[int, tuple[int, ...] | None]:
        """Layer -> the KV heads that keep every token there (None: all of them). ``backfill``
        joins with "+" layer ranges ("12-23"), layers ("18") and KV heads of a layer ("18.2"):
        "17.1+18.2+20"."""
        if self.backfill is None:
            return {}
        out: dict[int, set[int] | None] = {}
        for part in str(self.backfill).split("+"):
            layer, dot, head = part.partition(".")
            a, sep, b = layer.partition("-")
            b = b if sep else a
            if not (a.isdigit() and b.isdigit() and int(a) <= int(b) and (not dot or (head.isdigit() and not sep))):
                raise UsageError(f"backfill must name layers and heads as A-B, L or L.H joined by +, got {self.backfill!r}",
                                 hint="e.g. 12-23, 18+20 or 18.2+20.1", param="backfill")
            for i in range(int(a), int(b) + 1):
                if not dot:
                    out[i] = None
                elif out.get(i, set()) is not None:
                    out[i] = out.get(i, set()) | {int(head)}
        return {i: None if h is None else tuple(sorted(h)) for i, h in sorted(out.items())}

    @property
    def backfill_label(self) -> str:
        """``backfill`` as the label spells it: as given when it names whole layers, else (a
        list of heads outgrows the catalog's 64-byte labels) the number of KV heads it names
        and a hash of their set, the same for the same set in any order ("8h1c2d3e")."""
        heads = self.backfill_heads
        if all(h is None for h in heads.values()):
            return str(self.backfill)
        canon = str(self.backfill)  # already in one spelling (__post_init__)
        n = sum(1 if h is None else len(h) for h in heads.values())  # a whole layer counts once
        return f"{n}h{hashlib.sha256(canon.encode()).hexdigest()[:6]}"

    @property
    def backfill_shifts(self) -> tuple[int, int]:
        """(keys, values): the backfilled tokens' steps are 2**shift x the kept tokens' in that role."""
        ks = self.backfill_shift if self.backfill_key_shift is None else self.backfill_key_shift
        return ks, self.backfill_shift

    @property
    def tail_level(self) -> int:
        """ec: the level of the header and the forced tail (``protect_level``, or the default)."""
        return PROTECT_LEVEL if self.protect_level is None else self.protect_level

    @property
    def sized(self) -> bool:
        return self.budget is not None

    @property
    def auto_layers(self) -> str:
        """ec's default split: fisher's probe repeats the document over its cache, a measure of
        damage where every token is kept (with eviction it cost 4 of 60 needles at 0.083)."""
        return "fisher" if self.keep >= 1 else "even"

    def default_label(self) -> str:
        if self.sized:
            label = f"{self.quant}-b{self.budget:g}"
            if self.method != "kvcrush":
                label = f"{self.method}-{label}"
            if self.keep < 1:
                label += f"-k{self.keep:g}"
            if self.protect:
                label += f"-p{self.protect}"
            if self.protect_level is not None:
                label += f"-pl{self.protect_level}"
            if self.lift:
                label += f"-l{self.lift}"
                if self.lift_share is not None:
                    label += f"{self.lift_share:g}"
                if self.lift_level is not None:
                    label += f"x{self.lift_level}"
                if self.lift_role == "keys":
                    label += "k"
            if self.key_weight != sizing.KEY_WEIGHT:
                label += f"-kw{self.key_weight:g}"
            if self.quant == "ec" and self.layers != self.auto_layers: label += f"-{self.layers}"  # noqa: E701
            if self.backfill:
                label += f"-bf{self.backfill_label}"
                if self.backfill_shift != BACKFILL_SHIFT:
                    label += f"s{self.backfill_shift}"
                if self.backfill_key_shift is not None:
                    label += f"ks{self.backfill_key_shift}"
            if self.key_basis != "auto":
                label += {"model": "-kbm", "none": "-kb0"}[self.key_basis]
            if self.refit:
                label += f"-rf{self.refit:g}" + ("h" if self.refit_hold else "") + ("d" if self.refit_decoded else "") \
                    + ("f" if self.refit_feedback else "")
            if self.tail_reads:
                label += f"-tr{self.tail_reads:g}"
        else:
            label = f"{self.method}-k{self.keep:g}" if self.keep < 1 else "k1"
        if self.group_size != DEFAULT_GROUP_SIZE and self.quant not in ("none", "fp16"):
            label += f"-g{self.group_size}"  # two group sizes are two different versions
        if (self.keep < 1 or self.sized) and self.allocator != DEFAULT_ALLOCATOR:
            label = f"{self.allocator}-{label}"
        if self.scorer != DEFAULT_SCORER:
            label += f"-{self.scorer}"
        if not self.sized and self.quant != "none":
            label += f"-{self.quant}"
        return label

    def build_press(self, header_tokens: int = 0) -> Press:
        """The press, keeping at least the ``header_tokens`` prompt-header tokens as sinks."""
        press = get_press(self.method, **self.method_options)
        if header_tokens > press.sink_tokens:
            # The prompt header (system prompt, start of the user turn) precedes every question
            # and is where attention sinks live: it is always kept, as the press's sinks.
            press = dataclasses.replace(press, sink_tokens=header_tokens)
        if self.protect > press.recent_tokens:
            press = dataclasses.replace(press, recent_tokens=self.protect)
        return press

    def build_allocator(self) -> Allocator:
        return get_allocator(self.allocator, **self.allocator_options)

    @property
    def uses_scorer(self) -> bool:
        """The scorer ranks tokens for presses, weighs the ladder's damage, picks ``mixed``'s int8 tokens."""
        if self.sized and self.quant in ("ladder", "floor", "ec"):
            return self.quant != "ec" or self.keep < 1  # ec weighs channels by the model; a scorer only evicts
        if self.sized and self.keep == 1 and not sizing.may_evict(self.budget, self.quant, self.group_size):
            return False  # one tier that fits everywhere: nothing to rank
        return self.quant == "mixed" or press_class(self.method).uses_importance

    @property
    def needs_model(self) -> bool:
        return ((self.keep < 1 or self.sized) and self.scorer in NEEDS_MODEL and self.uses_scorer) or \
            (self.sized and (self.lift in NEEDS_MODEL or self.quant == "ec"))
