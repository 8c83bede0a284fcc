"""Tensor names of a bundle: the only place that spells them, and the meta keys every bundle
carries. Imports nothing of kdnctl (the format's modules and its readers all name tensors)."""

from __future__ import annotations

import torch

REQUIRED_META_KEYS = (
    "format_version", "model_fingerprint", "model", "doc_id", "doc_version", "chunk_index",
    "n_chunks", "token_start", "token_end", "chain_hash", "label", "parent", "recipe",
    "created", "tool_version", "dtype",
)
REQUIRED_MODEL_KEYS = ("n_layers", "n_kv_heads", "head_dim")


def tensor_name(layer: int, role: str) -> str:
    """Name of layer ``layer``'s tensor ``role``: ``keys``, ``values``, ``positions``, ``bias``,
    or a quantized part such as ``keys.q`` (see docs/bundle-format.md)."""
    return f"layers.{layer}.{role}"


def role_levels(tensors: dict, layer: str, role: str):
    """The token levels one role of one layer (``layers.i``) was coded with: the role's own
    (``--backfill-key-shift``, 1.5), else the layer's (``--backfill``, 1.4), else the chunk's for
    that role (``--lift-role keys``, 1.10: ``token_levels.keys``), else the chunk's."""
    for name in (f"{layer}.{role}.levels", f"{layer}.levels", f"token_levels.{role}", "token_levels"):
        if tensors.get(name) is not None:
            return tensors[name]
    return None


def stored_rows(tensors: dict, layer: str) -> torch.Tensor | None:
    """bool ``[H_kv, T]``: the rows layer ``layer`` (``layers.i``) stores where ``layers.i.narrow``
    marks heads holding the chunk's ``kept`` tokens only (1.8); None where every head holds every row."""
    narrow = tensors.get(f"{layer}.narrow")
    return None if narrow is None else held_rows(tensors["kept"], narrow)


def held_rows(kept: torch.Tensor, narrow: torch.Tensor) -> torch.Tensor:
    """bool ``[H_kv, T]``: every row of a wide head, the ``kept`` ``[T]`` rows of a ``narrow`` ``[H_kv]`` one."""
    return kept.bool().unsqueeze(0) | ~narrow.bool().unsqueeze(1)
