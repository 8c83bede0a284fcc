"""Fisher profile files: a model's profile (kdnctl/allocate/fisher_profile.py) as stored in a
store's catalog record (kdnctl/store/profiles.py): safetensors holding one float32 tensor
``fisher [L, 2, H, D]`` (layer, keys/values, KV head, channel), finite and non-negative."""

from __future__ import annotations

import torch

from kdnctl.errors import BundleFormatError


def check(profile, n_layers: int, n_heads: int, head_dim: int, what: str) -> torch.Tensor:
    """``profile`` if it is a finite, non-negative float32 ``[L, 2, H, D]`` of these sizes."""
    want = [n_layers, 2, n_heads, head_dim]
    if not isinstance(profile, torch.Tensor) or profile.dtype != torch.float32 or list(profile.shape) != want:
        got = f"{profile.dtype} {list(profile.shape)}" if isinstance(profile, torch.Tensor) else type(profile).__name__
        raise BundleFormatError(f"{what}: a Fisher profile must be float32 {want}, got {got}")
    if not bool(torch.isfinite(profile).all()) or bool((profile < 0).any()):
        raise BundleFormatError(f"{what}: a Fisher profile holds a negative or non-finite value")
    return profile


def encode(profile: torch.Tensor) -> bytes:
    """The profile's bytes (safetensors, one tensor ``fisher``)."""
    from safetensors.torch import save

    return save({"fisher": profile.float().contiguous()}, metadata={"kdnctl": "fisher_profile"})


def decode(data: bytes, what: str) -> torch.Tensor:
    """The profile in ``data`` (:func:`encode`'s bytes); unreadable -> ``BundleFormatError``."""
    from safetensors.torch import load

    try:
        t = load(bytes(data))["fisher"]
    except Exception as exc:  # safetensors raises its own error types
        raise BundleFormatError(f"{what} is not a readable Fisher profile: {str(exc)[:120]}") from None
    if t.dim() != 4 or t.shape[1] != 2:
        raise BundleFormatError(f"{what}: a Fisher profile must be [L, 2, H, D], got {list(t.shape)}")
    return check(t, t.shape[0], t.shape[2], t.shape[3], what)
