"""The experimental options of a compress recipe: one table, each entry its default, the check of
its value and what it does. A recipe keeps them in its ``options`` table (``--option KEY=VALUE``
on the command line, ``[compress.options]`` in a TOML recipe); the stage that reads one is named
beside it. An option left at its default is not recorded, so a version's record names only what
was chosen."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import UsageError
from ..quant.entropy import MAX_LEVEL

BACKFILL_SHIFT = 3  # the first backfill's shift: its records and labels still match
MAX_BACKFILL_SHIFT = 4  # the protected tokens sit 2 levels up and ec's finest level is 6
PROTECT_LEVEL = 2  # ec: the header and the forced tail 2**level finer; the default and the most
LIFT_SHARE, LIFT_LEVEL = 0.25, 1  # ec lift: the top quarter of the kept tokens, 2x finer steps
MAX_LIFT_LEVEL = MAX_LEVEL - PROTECT_LEVEL  # a lifted token may sit above the header's level
KEY_BASES = ("auto", "model", "none")
KEY_WEIGHT = 1.0


def _bad(name: str, want: str, value: Any, hint: str | None = None) -> UsageError:
    return UsageError(f"option {name} must be {want}, got {value!r}", hint=hint, param=name)


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _int_range(lo: int, hi: int) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise _bad(name, f"a whole number from {lo} to {hi}", value)
        return value
    return check


def _share(lo_open: bool, hi: float, hi_open: bool) -> Callable[[str, Any], float | None]:
    def check(name: str, value: Any) -> float | None:
        ok = _number(value) and (value > 0 if lo_open else value >= 0) and (value < hi if hi_open else value <= hi)
        if not ok:
            raise _bad(name, f"a share {'above' if lo_open else 'from'} 0 {'and below' if hi_open else 'to'} {hi:g}", value)
        return float(value)
    return check


def _ridge(name: str, value: Any) -> float | None:
    if not _number(value) or value < 0:
        raise _bad(name, "a ridge weight >= 0 (0: off)", value, hint="e.g. 0.01")
    return float(value) or None


def _positive(name: str, value: Any) -> float:
    if not _number(value) or not value > 0:
        raise _bad(name, "a number > 0", value)
    return float(value)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def _choice(*choices: str) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if value not in choices:
            raise _bad(name, " or ".join(choices), value)
        return value
    return check


def _scorer(name: str, value: Any) -> str | None:
    from ..scorers import SCORERS

    if value == "none":
        return "none"  # opts out of the auto recipe's lift (resolved by the recipe)
    for part in str(value).split("+") if name == "lift" else [value]:
        if part not in SCORERS:
            raise UsageError(f"unknown scorer {part!r} for option {name}", hint=f"choose one of {', '.join(SCORERS)}"
                             + (" (several joined by +: the better rank of them)" if name == "lift" else ""), param=name)
    return value


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(name, "a non-empty string", value)
    return value


@dataclass(frozen=True)
class Option:
    default: Any
    check: Callable[[str, Any], Any]
    reader: str  # the stage(s) that read it (kdnctl.compress.stages)
    help: str


OPTIONS: dict[str, Option] = {
    "coding": Option("zlib+params", _choice("zlib", "zlib+params"), "ladder",
                     "floor/ladder/uniform: lossless coding of the codes (zlib) or of codes and scales (zlib+params)"),
    "lift": Option(None, _scorer, "score, precision", "a second scorer whose top tokens get finer steps; "
                   "several joined by + rank each token by the best of them (none: no lift)"),
    "lift_share": Option(None, _share(True, 1, False), "precision", f"with lift: the share of the kept tokens lifted "
                         f"(default {LIFT_SHARE})"),
    "lift_level": Option(None, _int_range(1, MAX_LIFT_LEVEL), "precision", f"with lift: the lifted tokens' steps are "
                         f"2**N finer (default {LIFT_LEVEL})"),
    "lift_role": Option(None, _choice("keys"), "precision", "with lift: keys lifts the keys alone (default: both roles)"),
    "key_weight": Option(KEY_WEIGHT, _positive, "ladder, quantize", "a key error's damage relative to a value error's"),
    "layers": Option(None, _choice("fisher", "even"), "quantize", "fisher: steps per layer and role scaled by a Fisher "
                     "estimate of their damage (default, but with backfill); even: the same relative error"),
    "backfill": Option(None, _text, "precision, quantize, encode", "with keep < 1: layers A-B, L or KV heads L.H (joined by +) also keep "
                       "the evicted tokens, at coarser steps"),
    "backfill_shift": Option(BACKFILL_SHIFT, _int_range(0, MAX_BACKFILL_SHIFT), "precision",
                             "with backfill: the evicted tokens' steps are 2**S x the kept ones'"),
    "backfill_key_shift": Option(None, _int_range(0, MAX_BACKFILL_SHIFT), "precision",
                                 "with backfill: the keys' own shift (default: backfill_shift)"),
    "key_basis": Option("auto", _choice(*KEY_BASES), "coder", "auto: keys in the model's principal axes where one is "
                        "registered; model: require one; none: keys in channels"),
    "refit": Option(None, _ridge, "refit", "with keep < 1: refit the kept values so that the document's own "
                    "queries read the full cache's attention output; the ridge weight (0: off)"),
    "refit_hold": Option(False, _flag, "select", "with refit and lift: the lifted tokens keep their values"),
    "refit_decoded": Option(False, _flag, "encode", "with refit: fit to the keys as the loader decodes them"),
    "refit_feedback": Option(False, _flag, "quantize", "with refit: round the values with error feedback"),
    "protect_level": Option(None, _int_range(0, PROTECT_LEVEL), "precision", "the header's and the protected tail's "
                            f"steps are 2**N finer (default {PROTECT_LEVEL})"),
    "fit": Option("search", _choice("search", "secant"), "encode", "how ec fits its scale to the byte cap: search "
                  "(bisection, about 14 encodings) or secant (3-4 encodings, within 0.2% under the cap)"),
    "tail_reads": Option(None, _share(False, 1, True), "select", "with keep < 1: the share of the kept tokens "
                         "chosen by what the document's last queries read (0: off)"),
    "window_layers": Option("whole", _choice("whole", "window"), "window_layers", "sliding-window layers: whole "
                            "(every token) or window (the document's last W tokens, all a following question reads)"),
}


def check_option(name: str, value: Any) -> Any:
    """``value`` of option ``name`` as the recipe keeps it; a usage error naming the known options."""
    if name not in OPTIONS:
        raise UsageError(f"unknown compress option {name!r}", hint=f"known: {', '.join(OPTIONS)}", param="option")
    if value is None:
        return None
    value = OPTIONS[name].check(name, value)
    return None if value == 0 and name in ("tail_reads",) else value


def parse_value(text: str) -> Any:
    """``--option KEY=VALUE``'s value: true/false, a number, or the text itself."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text
