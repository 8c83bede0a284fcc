"""Allocators: how a document's token budget is split over layers (see :mod:`.base`); and across
precision tiers under a byte cap (:mod:`.tiers`, used by the size budget in ``kdnctl.compress.sizing``).

One file per allocator; ``ALLOCATORS`` is the registry the CLI, recipes and ``kdnctl methods``
share. To add one: subclass :class:`Allocator` in a new file, list it here.
"""

from __future__ import annotations

from typing import Any

from kdnctl.allocate.adaptive import AdaptiveAllocator
from kdnctl.allocate.base import Allocator, allocate
from kdnctl.allocate.pyramid import PyramidAllocator
from kdnctl.allocate.uniform import UniformAllocator
from kdnctl.registry import build

DEFAULT_ALLOCATOR = "uniform"

ALLOCATORS: dict[str, type[Allocator]] = {
    cls.name: cls for cls in (UniformAllocator, PyramidAllocator, AdaptiveAllocator)
}


def get_allocator(name: str = DEFAULT_ALLOCATOR, **opts: Any) -> Allocator:
    """An allocator by registry name with options (dataclass fields of its class)."""
    return build("allocator", ALLOCATORS, name, opts)


__all__ = ["ALLOCATORS", "DEFAULT_ALLOCATOR", "AdaptiveAllocator", "Allocator", "PyramidAllocator",
           "UniformAllocator", "allocate", "get_allocator"]
