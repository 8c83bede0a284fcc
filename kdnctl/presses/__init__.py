"""Pruning methods ("presses"): which tokens of a document's KV cache to keep, per layer and
KV head, for a given budget. Pure tensor code; see :mod:`kdnctl.presses.base` for the
conventions and :func:`kdnctl.presses.allocate.select_document` for chunked documents.
"""

from __future__ import annotations

from typing import Any

from kdnctl.errors import UsageError
from kdnctl.presses.adaptive import AdaptivePress
from kdnctl.presses.base import Press, ScoreContext, press_fields, validate_budget
from kdnctl.presses.h2o import H2OPress
from kdnctl.presses.knorm import KNormPress
from kdnctl.presses.kvcrush import KVCrushPress
from kdnctl.presses.pyramid import PyramidPress
from kdnctl.presses.random import RandomPress
from kdnctl.presses.shared import SharedPress
from kdnctl.presses.snapkv import SnapKVPress
from kdnctl.presses.spans import SpansPress
from kdnctl.presses.streaming import StreamingPress
from kdnctl.presses.wrapper import LayerBudgetWrapper

PRESSES: dict[str, type[Press]] = {
    cls.name: cls
    for cls in (
        SnapKVPress,
        H2OPress,
        StreamingPress,
        KNormPress,
        RandomPress,
        KVCrushPress,
        PyramidPress,
        SpansPress,
        AdaptivePress,
        SharedPress,
    )
}


def _coerce(name: str, option: str, value: Any, default: Any) -> Any:
    """Option values from the command line arrive as strings; convert them to the type of
    the option's default so ``kernel_size=5`` works as well as ``kernel_size="5"``."""
    if not isinstance(value, str) or default is None or isinstance(default, str):
        return value
    try:
        if isinstance(default, bool):
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if isinstance(default, int):
            return int(value)
        if isinstance(default, float):
            return float(value)
    except ValueError:
        raise UsageError(
            f"press '{name}': option {option}={value!r} is not a valid {type(default).__name__}"
        ) from None
    return value


def get_press(name: str, **opts: Any) -> Press:
    """A press by registry name with options (dataclass fields of its class).

    For ``pyramid``, options that are not pyramid's own go to the wrapped press
    (``get_press("pyramid", press="kvcrush", ratio=0.3)``).
    """
    key = str(name).strip().lower()
    if key not in PRESSES:
        raise UsageError(
            f"unknown press {name!r}", hint=f"valid presses: {', '.join(sorted(PRESSES))}"
        )
    cls = PRESSES[key]
    defaults = press_fields(cls)
    if issubclass(cls, LayerBudgetWrapper):  # wrappers: other options go to the wrapped press
        inner = {k: v for k, v in opts.items() if k not in defaults}
        opts = {k: v for k, v in opts.items() if k in defaults}
        if inner:
            opts["press_options"] = {**opts.get("press_options", {}), **inner}
    unknown = sorted(set(opts) - set(defaults))
    if unknown:
        raise UsageError(
            f"press '{key}' has no option {', '.join(unknown)}",
            hint=f"options of {key}: {', '.join(defaults)}",
        )
    kwargs = {k: _coerce(key, k, v, defaults[k]) for k, v in opts.items()}
    return cls(**kwargs)


__all__ = [
    "PRESSES",
    "H2OPress",
    "KNormPress",
    "KVCrushPress",
    "AdaptivePress",
    "Press",
    "PyramidPress",
    "RandomPress",
    "ScoreContext",
    "SharedPress",
    "SnapKVPress",
    "StreamingPress",
    "get_press",
    "validate_budget",
]
