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

import collections
import functools
import math
import threading

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
    # every layer of a chunk rotates by the same positions, and a prefix layout's chunk c has the
    # same positions in every document: the tables are computed once per process for each set of positions
    p = positions.contiguous()
    return _COS_SIN.get((p.numpy().tobytes(), p.dtype, tuple(p.shape), d, float(theta)))


class _CosSinCache:
    """The cos/sin tables of the positions most recently asked for, up to ``limit`` bytes of
    tables (least recently used out first): a long document's chunks all stay, a whole
    document's positions at once (a compress) do not push out more than they need."""

    def __init__(self, limit: int):
        self.limit, self.bytes, self.lock = limit, 0, threading.Lock()
        self.tables: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: tuple):
        with self.lock:
            hit = self.tables.get(key)
            if hit is not None:
                self.tables.move_to_end(key)
                return hit
        raw, dtype, shape, d, theta = key
        hit = _cos_sin_of(torch.frombuffer(bytearray(raw), dtype=dtype).view(shape), d, theta)
        size = 2 * hit[0].numel() * 4
        with self.lock:
            if size <= self.limit and key not in self.tables:
                self.tables[key] = hit
                self.bytes += size
                while self.bytes > self.limit:
                    _, old = self.tables.popitem(last=False)
                    self.bytes -= 2 * old[0].numel() * 4
        return hit


# 64 MB: every 256-token chunk of a 64k-token context at head size 128
_COS_SIN = _CosSinCache(64 << 20)


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
