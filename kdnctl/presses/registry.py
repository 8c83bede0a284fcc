"""The presses that rank tokens themselves, by name: every press but the wrappers
(``shared``), which wrap one of these. ``kdnctl.presses.PRESSES`` adds the wrappers."""

from __future__ import annotations

from typing import Any

from kdnctl.presses.base import Press
from kdnctl.presses.h2o import H2OPress
from kdnctl.presses.knorm import KNormPress
from kdnctl.presses.kvcrush import KVCrushPress
from kdnctl.presses.random import RandomPress
from kdnctl.presses.snapkv import SnapKVPress
from kdnctl.presses.spans import SpansPress
from kdnctl.presses.streaming import StreamingPress
from kdnctl.registry import build

RANKING_PRESSES: dict[str, type[Press]] = {
    cls.name: cls for cls in (SnapKVPress, H2OPress, StreamingPress, KNormPress, RandomPress, KVCrushPress, SpansPress)
}


def get_ranking_press(name: str, **opts: Any) -> Press:
    """A press of ``RANKING_PRESSES`` by name with options (dataclass fields of its class)."""
    return build("press", RANKING_PRESSES, name, opts)
