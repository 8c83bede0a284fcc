"""One stored kept set per chunk (bundle format 1.9): layers whose tokens are the chunk's
``kept`` ones store no positions of their own.

An evicting ec version keeps one token set for all its pruned layers and heads
(kdnctl/compress/stages/select.py), so every pruned layer stored ``layers.{i}.positions [H_kv, T_k]``, the
same row H_kv x L times: 59 bytes per document token at ``--budget 0.083``, 3.1% of the cap
(``research/probes/bundle_bytes.py``), plus a header entry per layer. Since 1.9 the file holds
``kept_layers`` (uint8 ``[L]``, 1 = layer i's positions are ``positions[kept]`` in every head)
in their place. Only the file: the decoder rebuilds those positions in memory before any check
or reader sees the bundle, so a decoded 1.9 bundle looks exactly like the same bundle in 1.8,
and encoding it again gives the same bytes (the content address does not move).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import BundleFormatError
from .names import tensor_name

KEPT_LAYERS = "kept_layers"


def kept_positions_dtype(p: torch.Tensor) -> torch.dtype:
    """The dtype a layer's positions are stored in: int16 while they fit (a budget pays every byte)."""
    return torch.int16 if (int(p.max()) if p.numel() else 0) < 32768 else torch.int32


def _layer_name(i: int) -> str:
    return tensor_name(i, "positions")


def _shape(meta: dict[str, Any]) -> tuple[int, int]:
    model = meta.get("model") if isinstance(meta, dict) else None
    got = [model.get(k) if isinstance(model, dict) else None for k in ("n_layers", "n_kv_heads")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in got):
        raise BundleFormatError(f"{KEPT_LAYERS} needs meta model n_layers and n_kv_heads")
    return got[0], got[1]


def _kept_rows(tensors: dict[str, torch.Tensor], n_heads: int) -> torch.Tensor | None:
    """``positions[kept]`` as one layer stores them ([H_kv, T_k]), or None without a valid kept set."""
    kept, pos = tensors.get("kept"), tensors.get("positions")
    if kept is None or pos is None or kept.dtype != torch.uint8 or pos.dtype != torch.int64 \
            or kept.dim() != 1 or list(pos.shape) != list(kept.shape) or bool((kept > 1).any()):
        return None
    p = pos[kept.bool()]
    return p.to(kept_positions_dtype(p)).unsqueeze(0).expand(n_heads, -1)


def fold_kept_positions(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors to write for a validated bundle: each layer whose stored positions are the
    kept set's, in the dtype it would be rebuilt in, drops them and is marked in ``kept_layers``."""
    if KEPT_LAYERS in tensors:
        raise BundleFormatError(f"{KEPT_LAYERS!r} is the encoder's to write: give the layers' positions instead")
    n_layers, n_heads = _shape(meta)
    want = _kept_rows(tensors, n_heads)
    if want is None:
        return tensors
    marks = torch.zeros(n_layers, dtype=torch.uint8)
    for i in range(n_layers):
        lp = tensors.get(_layer_name(i))
        marks[i] = lp is not None and lp.dtype == want.dtype and lp.shape == want.shape and bool(torch.equal(lp, want))
    if not bool(marks.any()):
        return tensors
    dropped = {_layer_name(i) for i in torch.nonzero(marks).flatten().tolist()}
    out = {k: v for k, v in tensors.items() if k not in dropped}
    out[KEPT_LAYERS] = marks
    return out


def unfold_kept_positions(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Read side of ``fold_kept_positions``: the marked layers' positions rebuilt from the chunk's
    kept set, ``kept_layers`` gone. Raises BundleFormatError on a mark it cannot honour."""
    marks = tensors.get(KEPT_LAYERS)
    if marks is None:
        return tensors
    n_layers, n_heads = _shape(meta)
    if marks.dtype != torch.uint8 or list(marks.shape) != [n_layers] or bool((marks > 1).any()):
        raise BundleFormatError(f"{KEPT_LAYERS} must be uint8 [{n_layers}] of 0 and 1, "
                                f"got {marks.dtype} {list(marks.shape)}")
    rows = _kept_rows(tensors, n_heads)
    if rows is None:
        raise BundleFormatError(f"{KEPT_LAYERS} needs a valid 'kept' (uint8 [T] of 0 and 1) beside "
                                "'positions' (int64 [T])")
    out = {k: v for k, v in tensors.items() if k != KEPT_LAYERS}
    for i in torch.nonzero(marks).flatten().tolist():
        if _layer_name(i) in tensors:
            raise BundleFormatError(f"layer {i} is marked in {KEPT_LAYERS} and stores its own positions too")
        out[_layer_name(i)] = rows  # one shared view: these layers' positions are one row by construction
    return out
