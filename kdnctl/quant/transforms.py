"""Invertible transforms applied to K/V before low-bit quantization and undone after decoding.

- ``hadamard``: an orthonormal Walsh-Hadamard rotation of the head dimension. It spreads a few
  large channels over all of them, so a per-token group no longer spends its range on one
  outlier; being orthonormal, ``x @ H @ H.T == x`` and dot products are unchanged.
- ``unrope`` / ``rope``: stored keys carry RoPE for their original positions (post-RoPE). A key
  channel's statistics are stable across tokens before RoPE and rotate with the position after
  it, so per-channel key groups are tighter on pre-RoPE keys (KIVI, KVQuant). The positions are
  stored with the keys, so the rotation is removed before quantizing and re-applied after
  decoding; both follow the Llama "rotate half" convention with
  ``inv_freq = theta ** (-arange(0, d, 2) / d)``.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=8)
def _hadamard_cpu(d: int) -> torch.Tensor:
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two size, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(torch.float32)


def hadamard(d: int, device=None) -> torch.Tensor:
    """Orthonormal (and symmetric) ``[d, d]`` Sylvester-Hadamard matrix."""
    h = _hadamard_cpu(d)
    return h if device is None else h.to(device)


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``x [..., d] @ H`` (its own inverse, as ``H`` is symmetric and orthonormal)."""
    return x.float() @ hadamard(x.shape[-1], x.device)


def _cos_sin(positions: torch.Tensor, d: int, theta: float):
    if positions.device.type != "cpu" or positions.numel() == 0:
        return _cos_sin_of(positions, d, theta)
    # every layer of a chunk rotates by the same positions: compute the tables once per chunk
    p = positions.contiguous()
    return _cos_sin_cached(p.numpy().tobytes(), p.dtype, tuple(p.shape), d, float(theta))


@functools.lru_cache(maxsize=8)
def _cos_sin_cached(raw: bytes, dtype, shape: tuple, d: int, theta: float):
    return _cos_sin_of(torch.frombuffer(bytearray(raw), dtype=dtype).view(shape), d, theta)


def _cos_sin_of(positions: torch.Tensor, d: int, theta: float):
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=positions.device) / d)
    ang = positions.to(torch.float64)[..., None] * inv  # [..., d/2]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos().float(), ang.sin().float()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rope(keys: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Apply RoPE: ``keys [H, T, D]`` at ``positions [H, T]`` (or ``[T]``)."""
    cos, sin = _cos_sin(positions.to(keys.device), keys.shape[-1], theta)
    if cos.dim() == 2:
        cos, sin = cos.expand(keys.shape[0], -1, -1), sin.expand(keys.shape[0], -1, -1)
    k = keys.float()
    return k * cos + rotate_half(k) * sin


def unrope(keys: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Inverse of :func:`rope` (rotation by the negative angle)."""
    cos, sin = _cos_sin(positions.to(keys.device), keys.shape[-1], theta)
    if cos.dim() == 2:
        cos, sin = cos.expand(keys.shape[0], -1, -1), sin.expand(keys.shape[0], -1, -1)
    k = keys.float()
    return k * cos - rotate_half(k) * sin
