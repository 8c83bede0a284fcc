"""Sliding-window layers stored by their window (compress option ``window_layers=window``).

A sliding-window layer's query at position p reads only keys at positions > p - W, so a question
that follows a document of T tokens reads, in that layer, only the document's last W - 1 tokens.
Stored by window, such a layer keeps the document's last W tokens (every KV head; all of them
when the document is shorter) and nothing before: in every chunk, the kept positions are the
chunk's tokens at or after T - W (none for chunks that end before). Full-attention layers keep
what the rest of the recipe selects. The bundle's model record says ``stored: window`` for each
such layer; a load places them like any per-layer kept set, and kdnctl's attention (or the
model's own sliding-window cache layer, :func:`kdnctl.engine.window_cache.model_cache`) applies
the window by position.
"""

from __future__ import annotations

import copy

import torch

WHOLE, WINDOW = "whole", "window"


def window_sizes(model_meta: dict) -> dict[int, int]:
    """{layer: window} of the sliding-window layers a bundle's model record lists."""
    att = model_meta.get("attention") or []
    return {i: int(a["window"]) for i, a in enumerate(att) if a.get("kind") == "sliding" and a.get("window")}


def window_picks(picks: list[list[torch.Tensor]] | None, windows: dict[int, int],
                 local_bounds: list[tuple[int, int]], n_layers: int, n_heads: int) -> list[list[torch.Tensor]]:
    """Chunk-local kept indices per chunk and layer (``picks[c][i] [H, k]``; None: every token)
    with each window layer's replaced by the chunk's tokens among the document's last W."""
    n_tokens = local_bounds[-1][1]
    out = []
    for c, (s, e) in enumerate(local_bounds):
        row = []
        for i in range(n_layers):
            if i in windows:
                first = max(s, n_tokens - windows[i])
                idx = torch.arange(first - s, e - s) if first < e else torch.zeros(0, dtype=torch.long)
                row.append(idx.expand(n_heads, -1).contiguous())
            elif picks is None:
                row.append(torch.arange(e - s).expand(n_heads, -1).contiguous())
            else:
                row.append(picks[c][i])
        out.append(row)
    return out


def windowed_model_meta(model_meta: dict, windows: dict[int, int]) -> dict:
    """The model record with ``stored: window`` on each layer in ``windows``."""
    m = copy.deepcopy(model_meta)
    for i in windows:
        m["attention"][i]["stored"] = WINDOW
    return m


def by_window(recipe, model_meta: dict, picks, local_bounds, n_layers: int, n_heads: int) -> tuple:
    """(picks, extra bundle meta) for ``recipe``'s option ``window_layers``: unchanged with
    ``whole`` or a model without sliding-window layers; else window layers keep their last W."""
    from kdnctl.errors import UsageError

    windows = window_sizes(model_meta) if recipe.options.get("window_layers", WHOLE) == WINDOW else {}
    if not windows:
        return picks, {}
    if recipe.sized and recipe.quant == "ec":
        return picks, {}  # the ec layout keeps each window layer's window itself (ec_windows)
    if recipe.sized:
        raise UsageError(f"option window_layers=window selects the tokens of sliding-window layers, which the "
                         f"size-budgeted {recipe.quant} layout does not take", hint="use it with --quant ec (the "
                         "default with --budget), or with --keep K and/or --quant Q without --budget",
                         param="window_layers")
    return window_picks(picks, windows, local_bounds, n_layers, n_heads), {"model": windowed_model_meta(model_meta,
                                                                                                        windows)}


def ec_windows(recipe, model_meta: dict, kept_positions: torch.Tensor, doc_end: int,
               other_lengths: bool) -> tuple[dict[int, int], dict]:
    """For the ``ec`` layout: ({window layer: index, in the kept sequence, of its first token},
    extra bundle meta) under ``window_layers=window``; ({}, {}) otherwise. ``kept_positions``:
    the kept tokens' positions, ascending; ``other_lengths``: the recipe gives some layers other
    lengths already (backfill), which a window does not combine with."""
    from kdnctl.errors import UsageError

    windows = window_sizes(model_meta) if recipe.options.get("window_layers", WHOLE) == WINDOW else {}
    if not windows:
        return {}, {}
    if other_lengths:
        raise UsageError("option window_layers=window does not combine with backfill", param="window_layers")
    starts = {i: int((kept_positions < doc_end - w).sum()) for i, w in windows.items()}
    return starts, {"model": windowed_model_meta(model_meta, windows)}


def first_row(starts: dict[int, int], i: int, ks: int, ke: int) -> int:
    """The first row of the kept range ``[ks, ke)`` that layer ``i`` stores."""
    return min(max(ks, starts[i]), ke) if i in starts else ks
