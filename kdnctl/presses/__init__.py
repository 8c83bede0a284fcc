"""Pruning methods ("presses"): which tokens of a document's KV cache to keep, per layer and
KV head, for a given per-layer quota. Pure tensor code; see :mod:`kdnctl.presses.base` for the
conventions, :mod:`kdnctl.allocate` for how quotas are split over layers and
:func:`kdnctl.presses.document.select_document` for chunked documents.
"""

from __future__ import annotations

from typing import Any

from kdnctl.errors import UsageError
from kdnctl.presses.base import Press, ScoreContext, validate_budget
from kdnctl.presses.h2o import H2OPress
from kdnctl.presses.knorm import KNormPress
from kdnctl.presses.kvcrush import KVCrushPress
from kdnctl.presses.random import RandomPress
from kdnctl.presses.registry import RANKING_PRESSES
from kdnctl.presses.shared import SharedPress
from kdnctl.presses.snapkv import SnapKVPress
from kdnctl.presses.spans import SpansPress
from kdnctl.presses.streaming import StreamingPress
from kdnctl.registry import build

# every press by name: the ranking presses (presses/registry.py) and the wrappers around them
PRESSES: dict[str, type[Press]] = {**RANKING_PRESSES, SharedPress.name: SharedPress}


def press_class(name: str) -> type[Press]:
    """The class of a press by registry name (its class attributes, without building one)."""
    key = str(name).strip().lower()
    if key not in PRESSES:
        raise UsageError(f"unknown press {name!r}", hint=f"valid presses: {', '.join(sorted(PRESSES))}")
    return PRESSES[key]


def get_press(name: str, **opts: Any) -> Press:
    """A press by registry name with options (dataclass fields of its class)."""
    return build("press", PRESSES, name, opts)


__all__ = [
    "PRESSES",
    "H2OPress",
    "KNormPress",
    "KVCrushPress",
    "Press",
    "RandomPress",
    "ScoreContext",
    "SharedPress",
    "SnapKVPress",
    "SpansPress",
    "StreamingPress",
    "get_press",
    "press_class",
    "validate_budget",
]
