"""KVCrush selection pieces, dispatched between Triton and the torch reference.

- :func:`binarize`: per-row threshold ``[..., T]`` -> uint8 head-behaviour bits.
- :func:`pack_bits`: bits -> int32 words (torch only; a reshape and a sum, no kernel needed).
- :func:`hamming`: distance of every packed vector to its group's anchor.
- :func:`gather_kept`: compaction of kept tokens of all layers in one launch;
  :func:`gather_layers` wraps it for ragged per-layer quotas.

The public functions here validate and allocate; the two backends only compute, so the
argument checks exist once. The rule for which backend runs is ``dispatch.use_triton``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kdnctl.kernels.dispatch import use_triton
from kdnctl.kernels.kvcrush import reference
from kdnctl.kernels.kvcrush.reference import WORD_BITS, pack_bits, popcount32

__all__ = [
    "WORD_BITS",
    "binarize",
    "gather_kept",
    "gather_layers",
    "hamming",
    "pack_bits",
    "popcount32",
]


def _backend(*tensors: Tensor):
    if use_triton(*tensors):
        from kdnctl.kernels.kvcrush import triton as backend  # lazy: needs triton installed

        return backend
    return None


def binarize(scores: Tensor, thresholds: Tensor, *, out: Tensor | None = None) -> Tensor:
    """Bits ``[..., T]`` uint8: 1 where ``scores > thresholds[..., None]`` (strictly)."""
    if scores.shape[:-1] != thresholds.shape:
        raise ValueError(f"thresholds {tuple(thresholds.shape)} do not match scores {tuple(scores.shape)}")
    scores = scores.float().contiguous()
    thresholds = thresholds.float().contiguous()
    if out is None:
        out = torch.empty(scores.shape, dtype=torch.uint8, device=scores.device)
    backend = _backend(scores, thresholds)
    if backend is None:
        return reference.binarize(scores, thresholds, out=out)
    return backend.binarize(scores, thresholds, out)


def hamming(words: Tensor, anchor: Tensor, *, out: Tensor | None = None) -> Tensor:
    """int32 ``[G, N, W]`` packed vectors, int32 ``[G, W]`` anchors -> int32 ``[G, N]``."""
    if words.dim() != 3 or anchor.shape != (words.shape[0], words.shape[2]):
        raise ValueError(f"words {tuple(words.shape)} / anchor {tuple(anchor.shape)}: need [G,N,W] / [G,W]")
    if words.dtype != torch.int32 or anchor.dtype != torch.int32:
        raise ValueError("packed words and anchors must be int32 (see pack_bits)")
    words = words.contiguous()
    anchor = anchor.contiguous()
    if out is None:
        out = torch.empty(words.shape[:2], dtype=torch.int32, device=words.device)
    backend = _backend(words, anchor)
    if backend is None:
        return reference.hamming(words, anchor, out=out)
    return backend.hamming(words, anchor, out)


def gather_kept(x: Tensor, idx: Tensor, *, out: Tensor | None = None) -> Tensor:
    """``[L, H, T, D]`` and int64 ``[L, H, k]`` -> ``[L, H, k, D]``, all layers at once."""
    if x.dim() != 4 or idx.dim() != 3 or idx.shape[:2] != x.shape[:2]:
        raise ValueError(f"x {tuple(x.shape)} / idx {tuple(idx.shape)}: need [L,H,T,D] / [L,H,k]")
    # The kernel would read out of bounds silently, so indices are checked here for both paths.
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= x.shape[2]):
        raise ValueError(f"kept indices must lie in [0, {x.shape[2]})")
    x = x.contiguous()
    idx = idx.to(torch.int64).contiguous()
    if out is None:
        out = torch.empty(*idx.shape, x.shape[-1], dtype=x.dtype, device=x.device)
    backend = _backend(x, idx)
    if backend is None:
        return reference.gather_kept(x, idx, out=out)
    return backend.gather_kept(x, idx, out)


def gather_layers(x: Tensor | list[Tensor], kept: list[Tensor]) -> list[Tensor]:
    """Per layer ``[H, k_l, D]`` from dense ``[L, H, T, D]`` (or a list of ``[H, T, D]``) and
    per-layer kept indices ``[H, k_l]`` whose k_l may differ (pyramid quotas).

    Indices are padded to the largest k by repeating each row's last index (always a valid
    position) so one launch covers every layer; the padding is sliced off afterwards.
    """
    dense = torch.stack(list(x)) if isinstance(x, (list, tuple)) else x
    if len(kept) != dense.shape[0]:
        raise ValueError(f"{len(kept)} index tensors for {dense.shape[0]} layers")
    k_max = max((int(k.shape[-1]) for k in kept), default=0)
    l, h = dense.shape[:2]
    idx = torch.zeros(l, h, k_max, dtype=torch.int64, device=dense.device)
    for i, k in enumerate(kept):
        n = k.shape[-1]
        if n:
            idx[i, :, :n] = k
            idx[i, :, n:] = k[:, -1:]
    res = gather_kept(dense, idx)
    return [res[i, :, : kept[i].shape[-1]] for i in range(l)]
