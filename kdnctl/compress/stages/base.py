"""The compress pipeline's shared state and stage interface.

A stage is a small class with one ``run(job)``: it reads what the stages before it put on the
``Job`` and adds its own part. ``kdnctl.compress.stages.PIPELINE`` names the stages in order;
``STAGES`` finds each by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch


@dataclass
class Job:
    """One document on its way through the pipeline.

    Given: the source version ``src``, the new version's ``label`` and recipe ``step``, the
    ``recipe``, the source ``bundles``, dense ``keys``/``values`` per layer ``[H, T, D]``,
    ``token_ids``, each chunk's ``[start, end)`` in the document (``local_bounds``), the fp16
    size ``fp16``, the loaded model ``lm``, the ``lift`` ranks and the scorer's ``importance``
    (``[L, H, T]``, or None). Each stage fills its fields below."""

    src: Any
    label: str
    step: dict
    recipe: Any
    bundles: list
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    token_ids: list[int]
    local_bounds: list[tuple[int, int]]
    fp16: int
    lm: Any
    lift: torch.Tensor | None = None
    importance: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    theta: float | None = None  # the keys' RoPE base; None: keys are coded as stored, after RoPE
    # score: the press and allocator the recipe builds, the scorer's context and its seconds
    dense: list = field(default_factory=list)  # per chunk, per layer (keys, values) as stored
    press: Any = None
    allocator: Any = None
    ctx: Any = None
    score_seconds: float = 0.0
    picks: list | None = None  # evict: per chunk, per layer, the kept chunk-local indices
    # select: the kept document indices (None: every token) and the kept tokens the refit holds
    rows: torch.Tensor | None = None
    hold: torch.Tensor | None = None
    all_keys: list[torch.Tensor] = field(default_factory=list)
    all_values: list[torch.Tensor] = field(default_factory=list)
    # refit: the document's own queries and attention scales the values are fitted to, and
    # whether they were read from the stored K/V (no forward measured the key weights)
    fit_queries: tuple | None = None
    queries_read_cache: bool = False
    check_queries: list | None = None  # per layer: held-out queries each head's fit is checked on
    # precision: per-token levels (by role), backfilled layers and their levels, channel weights
    positions: torch.Tensor | None = None
    all_positions: torch.Tensor | None = None
    kept_bounds: list[tuple[int, int]] = field(default_factory=list)
    levels: torch.Tensor | None = None
    levels_by_role: tuple = ()
    split: bool = False
    backfill: list[int] = field(default_factory=list)
    shifts: tuple[int, int] = (0, 0)
    full_levels: list[torch.Tensor] = field(default_factory=list)
    finest: int = 0
    key_weights: list | None = None
    value_weights: list | None = None
    # quantize: the quantizer, the transformed layers, per-channel steps and their floors
    quantizer: Any = None
    basis: torch.Tensor | None = None
    xs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    narrow: dict[int, list[int]] = field(default_factory=dict)
    narrow_mask: dict[int, torch.Tensor] = field(default_factory=dict)
    evicted: torch.Tensor | None = None
    base: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    floors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    mult: torch.Tensor | None = None
    # window_layers=window: {window layer: index of its first kept row}, and the bundles' model record
    wins: dict[int, int] = field(default_factory=dict)
    win_meta: dict = field(default_factory=dict)
    # encode: tensors and meta per chunk, kept fraction, row mix
    result: tuple | None = None

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def header(self) -> int:
        return int(self.bundles[0].meta.get("header_tokens", 0))

    @property
    def cap(self) -> float:
        return self.recipe.budget * self.fp16


class Stage:
    """Base of every stage."""

    name: ClassVar[str] = "base"

    def run(self, job: Job) -> None:
        raise NotImplementedError
