"""A ``kdnctl compress`` recipe: what to keep and how to store it, resolved once (``quant`` auto
picks the method for the budget here), its catalog record (``as_dict``) and its default name."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import Any

from . import sizing
from ..allocate import ALLOCATORS, DEFAULT_ALLOCATOR, Allocator, get_allocator
from .options import (BACKFILL_SHIFT, KEY_BASES, LIFT_LEVEL, LIFT_SHARE, MAX_BACKFILL_SHIFT,  # noqa: F401
                               MAX_LIFT_LEVEL, OPTIONS, PROTECT_LEVEL, check_option)
from ..errors import UsageError
from ..presses import get_press, press_class
from ..presses.base import Press, validate_budget
from ..quant.base import DEFAULT_GROUP_SIZE
from ..quant.entropy import MAX_LEVEL
from ..registry import method_fields
from ..scorers import DEFAULT_SCORER, NEEDS_MODEL

# Old spellings of the per-layer allocators, once presses wrapping a press ("pyramid:kvcrush", ...).
_LEGACY_WRAPPED = {"pyramid": "snapkv", "adaptive": "kvcrush"}
# Old spellings of the press fields (recipes, records and callers before the press was named so).
_LEGACY_FIELDS = {"method": "press", "method_options": "press_options"}


@dataclass(init=False)
class CompressRecipe:
    """``budget``: size cap as a fraction of the fp16 K/V bytes (None: no cap, pure eviction);
    ``keep``: fraction of tokens kept per layer and KV head; ``quant``: with a budget ``auto``
    (None: ``sizing.auto_quant`` picks for the budget), ``uniform`` (the best single tier that
    fits), ``floor`` (that tier + one-tier upgrades), ``ladder`` (per-token tiers), ``ec``
    (per-channel steps, entropy-coded), ``int4``..., ``fp16`` (eviction alone); without one, the
    quantizer of every kept token; ``scorer`` ranks the tokens; ``press`` selects the kept tokens
    (``press_options`` its settings); ``allocator`` splits the kept share across layers;
    ``protect``: the prompt header and the last N tokens are never evicted and get precision
    first; ``options``: the experimental settings (``kdnctl.compress.options.OPTIONS``)."""

    budget: float | None = 0.25
    keep: float = 1.0
    quant: str | None = None
    scorer: str | None = None  # None: DEFAULT_SCORER, or what quant auto chose for the budget
    press: str = "kvcrush"
    press_options: dict[str, Any] = field(default_factory=dict)
    allocator: str = DEFAULT_ALLOCATOR
    allocator_options: dict[str, Any] = field(default_factory=dict)
    protect: int = 0
    group_size: int = DEFAULT_GROUP_SIZE
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)

    def __init__(self, budget: float | None = 0.25, keep: float = 1.0, quant: str | None = None, scorer: str | None = None,
                 press: str = "kvcrush", press_options: dict | None = None, allocator: str = DEFAULT_ALLOCATOR,
                 allocator_options: dict | None = None, protect: int = 0, group_size: int = DEFAULT_GROUP_SIZE,
                 seed: int = 0, options: dict | None = None, **named: Any) -> None:
        """Every option can also be given by name (``refit=0.01``): it goes into ``options``;
        ``method``/``method_options`` are the press fields' old names."""
        self.budget, self.keep, self.quant, self.scorer = budget, keep, quant, scorer
        self.press, self.press_options = press, dict(press_options or {})
        self.allocator, self.allocator_options = allocator, dict(allocator_options or {})
        self.protect, self.group_size, self.seed = protect, group_size, seed
        self.options = dict(options or {})
        for name, value in named.items():
            if name in _LEGACY_FIELDS:
                setattr(self, _LEGACY_FIELDS[name], dict(value or {}) if name == "method_options" else value)
            elif name in OPTIONS:
                if value is not None:
                    self.options[name] = value
            else:
                raise TypeError(f"CompressRecipe got an unexpected argument {name!r}")
        self.__post_init__()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CompressRecipe":
        """A recipe from a TOML ``[compress]`` table or a version's record (``as_dict``): the
        fields by name, the options by name or in ``options``; a press's or an allocator's own
        settings in ``options`` (the old ``[compress.options]``) go to them."""
        d = {_LEGACY_FIELDS.get(k, k): v for k, v in d.items() if k not in ("step", "source")}
        own = {f.name for f in dataclasses.fields(cls)}
        bad = sorted(k for k in d if k not in own and k not in OPTIONS)
        if bad:
            raise UsageError(f"unknown compress settings {bad}", hint=f"fields: {', '.join(sorted(own))}; "
                             f"options: {', '.join(OPTIONS)}", param="option")
        options, press_options = dict(d.pop("options", None) or {}), dict(d.pop("press_options", None) or {})
        allocator_options = dict(d.pop("allocator_options", None) or {})
        wrapper, _, inner = str(d.get("press", "kvcrush")).partition(":")
        press_fields = method_fields(press_class(inner or _LEGACY_WRAPPED[wrapper] if wrapper in _LEGACY_WRAPPED else wrapper))
        alloc = str(d.get("allocator", DEFAULT_ALLOCATOR))
        alloc_fields = method_fields(ALLOCATORS[alloc]) if alloc in ALLOCATORS else set()
        for k in list(options):
            if k in OPTIONS:
                continue
            if k in press_fields or k in ("press", "press_options"):
                press_options[k] = options.pop(k)
            elif k in alloc_fields:
                allocator_options[k] = options.pop(k)
            else:
                raise UsageError(f"unknown compress option {k!r}", hint=f"options: {', '.join(OPTIONS)}; the press's: "
                                 f"{', '.join(sorted(press_fields)) or 'none'}", param="option")
        if "keep" in d and "budget" not in d:
            d["budget"] = None  # pure token eviction
        options.update({k: d.pop(k) for k in list(d) if k in OPTIONS})
        return cls(**d, press_options=press_options, allocator_options=allocator_options, options=options)

    @property
    def method(self) -> str:
        """The press's old name."""
        return self.press

    @property
    def method_options(self) -> dict[str, Any]:
        return self.press_options

    def __post_init__(self) -> None:
        # an option given as None is unset; one given as 0 (refit, tail_reads) is off, and stays so
        self.options = {k: v for k, v in self.options.items() if v is not None}
        for name, value in list(self.options.items()):
            self.options[name] = check_option(name, value)
        self.keep = validate_budget(self.keep)
        if not isinstance(self.protect, int) or isinstance(self.protect, bool) or self.protect < 0:
            raise UsageError(f"protect must be a whole number of tokens >= 0, got {self.protect!r}", param="protect")
        no_lift = self.lift == "none"  # opts out of the auto recipe's lift
        if no_lift:
            self.lift = None
        if self.budget is not None:
            self.budget = validate_budget(self.budget)
            if self.quant in (None, "auto"):
                self._apply_auto(no_lift)
            if self.quant != "ec": sizing.ladder_for(self.quant)  # noqa: E701 (an unknown quant is refused here)
        elif self.quant is None:
            self.quant = "none"
        elif self.quant == "ec":
            raise UsageError("--quant ec fits its steps to a byte cap", hint="add --budget B", param="quant")
        if self.scorer is None:
            self.scorer = DEFAULT_SCORER
        self.layers = self.layers or self.auto_layers  # after the options: it depends on backfill
        self._check_options()
        wrapper, _, inner = str(self.press).partition(":")
        if wrapper in _LEGACY_WRAPPED:
            opts = dict(self.press_options)
            inner = inner or opts.pop("press", None) or _LEGACY_WRAPPED[wrapper]
            press_opts = opts.pop("press_options", {})
            own = method_fields(ALLOCATORS[wrapper])
            self.allocator, self.press = wrapper, str(inner)
            self.allocator_options = {**{k: v for k, v in opts.items() if k in own}, **self.allocator_options}
            self.press_options = {**{k: v for k, v in opts.items() if k not in own}, **press_opts}

    def _apply_auto(self, no_lift: bool) -> None:
        """quant auto: the method, kept share, protected tail, scorer, lift and refit for the budget
        (sizing.auto_quant); an option the user set stands as given."""
        auto = sizing.auto_quant(self.budget, self.group_size)
        self.quant, self.keep, self.protect = auto.quant, min(self.keep, auto.keep), max(self.protect, auto.protect)
        if self.scorer is None and auto.scorer is not None:
            self.scorer = auto.scorer
        # with backfill the wide rows share the cap and the auto lift cost facts there: the user chooses a lift
        if auto.lift and self.lift is None and not no_lift and self.backfill is None:
            for name, value in auto.lift.items():
                if self.options.get(name) is None:
                    self.options[name] = value
        # the auto refit holds the lifted tokens' values, so it comes with a lift (the auto one or
        # the user's); refit 0 turns it off, a refit of the user's stands as given
        if auto.refit and "refit" not in self.options and self.lift and self.backfill is None and self.keep < 1:
            self.options.update(refit=auto.refit, refit_hold=True, refit_decoded=True, refit_feedback=True)
        # the sentences scorer is the same in every head: KVCrush's head-behaviour
        # representatives would be arbitrary, so the auto recipe keeps by importance alone
        if auto.ratio is not None and self.scorer == auto.scorer and str(self.press).partition(":")[0] == "kvcrush":
            self.press_options = {"ratio": auto.ratio, **self.press_options}

    def _check_options(self) -> None:
        """The options that only make sense together, checked together."""
        ec = self.sized and self.quant == "ec"
        evicting_ec = ec and self.keep < 1
        if self.backfill is not None:
            heads = self.backfill_heads  # parses: a bad spec is refused here
            if any(h is not None for h in heads.values()):  # one spelling per set of heads (record and label)
                self.backfill = "+".join(f"{i}" if h is None else "+".join(f"{i}.{x}" for x in h) for i, h in heads.items())
            if not (evicting_ec and self.layers == "even"):
                raise UsageError("option backfill keeps the tokens ec's keep evicts, coarsely, in some layers",
                                 hint="use it with --budget B --quant ec --keep K (layers even)", param="backfill")
        for name in ("backfill_shift", "backfill_key_shift"):
            if name in self.options and self.options[name] is not None and self.options[name] != OPTIONS[name].default \
                    and self.backfill is None:
                raise UsageError(f"option {name} sets how coarse backfill's tokens are", hint="add backfill=A-B",
                                 param=name)
        if self.key_basis != "auto" and not ec:
            raise UsageError("option key_basis rotates the keys of the entropy-coded ec layout",
                             hint="use it with --budget B --quant ec", param="key_basis")
        if self.refit and not (evicting_ec and self.backfill is None):
            raise UsageError("option refit refits the values of the tokens ec's keep keeps",
                             hint="use it with --budget B --quant ec --keep K (no backfill), or refit=0", param="refit")
        if self.refit_hold and not (self.refit and self.lift):
            raise UsageError("option refit_hold keeps the tokens lift lifts out of refit's fit",
                             hint="add refit=RHO (e.g. 0.01) and keep a lift (the auto recipe has one)", param="refit_hold")
        for name in ("refit_decoded", "refit_feedback"):
            if getattr(self, name) and not self.refit:
                raise UsageError(f"option {name} goes with refit's value fit",
                                 hint=f"add refit=RHO (e.g. 0.01), or drop {name}", param=name)
        if self.tail_reads and not evicting_ec:
            raise UsageError("option tail_reads chooses part of the tokens ec's keep keeps",
                             hint="use it with --budget B --quant ec --keep K, or tail_reads=0", param="tail_reads")
        if self.protect_level is not None and not ec:
            raise UsageError("option protect_level sets how fine ec stores the header and the protected tail",
                             hint="use it with --budget B --quant ec", param="protect_level")
        self._check_lift_steps()
        for name in [k for k, v in self.options.items() if v is not None and v == OPTIONS[k].default and k != "layers"]:
            del self.options[name]  # a default is not recorded (None stays: an option the user turned off)

    def _check_lift_steps(self) -> None:
        share, level = self.lift_share, self.lift_level
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise UsageError(f"lift_share must be a share above 0 and at most 1, got {share!r}",
                             hint="e.g. 0.05: the top 5% of the kept tokens by lift", param="lift_share")
        if level is not None and (isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= MAX_LIFT_LEVEL):
            raise UsageError(f"lift_level must be a whole number from 1 to {MAX_LIFT_LEVEL}, got {level!r}",
                             hint="2**level is how much finer the lifted tokens' steps are", param="lift_level")
        if level is not None and self.backfill is not None and level + max(self.backfill_shifts) > MAX_LEVEL:
            raise UsageError(f"lift_level {level} plus the backfill shift {max(self.backfill_shifts)} passes ec's "
                             f"finest level ({MAX_LEVEL})", hint="lower lift_level or backfill_shift",
                             param="lift_level")
        if self.lift_role not in (None, "keys"):
            raise UsageError(f"lift_role must be keys (or unset: both roles), got {self.lift_role!r}",
                             hint="lift_role=keys lifts the keys alone", param="lift_role")
        if (share is not None or level is not None or self.lift_role) and not (self.lift and self.sized and self.quant == "ec"):
            raise UsageError("options lift_share, lift_level and lift_role set how ec lifts the top tokens of lift",
                             hint="use them with --budget B --quant ec and lift=SCORER", param="lift_share")
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
        """ec's default split: steps per layer and role from the model's Fisher profile, at every
        budget (at 0.083 it keeps more word and digit answers than even steps do, at the same cap);
        backfill's coarse rows are spread evenly, so a backfill recipe defaults to even."""
        return "even" if self.backfill else "fisher"

    def default_label(self) -> str:
        """The new version's name: ``b0.25`` for a budget's own recipe (what ``--budget 0.25``
        alone makes); any other recipe is named by what it sets (``ec-b0.25-p64``)."""
        if self.sized and self.as_dict() == CompressRecipe(budget=self.budget).as_dict():
            return f"b{self.budget:g}"
        return self.recipe_label()

    def recipe_label(self) -> str:
        """The recipe spelled out: the name every version had before names were short."""
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
    def uses_key_basis(self) -> bool:
        """Whether this recipe codes keys with ``ec`` and may use a model's key basis."""
        return self.sized and self.quant == "ec" and self.key_basis != "none"

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
            (self.sized and (any(n in NEEDS_MODEL for n in (self.lift or "").split("+")) or self.quant == "ec"))


def _option_property(name: str) -> property:
    default = OPTIONS[name].default

    def get(self: CompressRecipe) -> Any:
        value = self.options.get(name)
        return default if value is None else value

    def put(self: CompressRecipe, value: Any) -> None:
        self.options[name] = value

    return property(get, put, doc=OPTIONS[name].help)


for _name in OPTIONS:  # recipe.refit, recipe.lift, ...: the options read as attributes
    setattr(CompressRecipe, _name, _option_property(_name))
