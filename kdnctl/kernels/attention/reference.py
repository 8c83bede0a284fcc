"""Plain-torch decode attention over a stored (dense or quantized) KV cache: the CPU path and
the ground truth that the Triton kernel in ``triton.py`` must match.

Semantics, for query head ``h`` and query ``i``::

    kv     = h // (Hq // Hkv)                          # GQA: consecutive query heads share a KV head
    s[t]   = scale * <query[h, i], K[kv, t]> + bias[h, (i,) t]
    out    = softmax(s) @ V[kv]                        # float32 [Hq, (Q,) D]

Every query sees every cached token: the new tokens being decoded are not in the cache, so no
causal mask applies among them (a caller that wants one passes it in a ``[Hq, Q, T]`` bias).
A row whose every score is -inf (all tokens masked) gives zeros, as torch's sdpa does, rather
than softmax's 0/0 = NaN, so a fully masked head cannot poison later layers; an empty cache
(T = 0) gives zeros too.

K and V are each either a dense ``[Hkv, T, D]`` float tensor or a :class:`QuantizedKV` in the
``kdnctl.kernels.quant`` layout (keys normally per channel, values per token); this reference
simply dequantizes them with ``kdnctl.kernels.quant.reference``. Scores and the softmax are
computed in float32 whatever the input dtypes, like the kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kdnctl.kernels.quant import reference as qref

MAX_HEAD_DIM = 256  # the kernel keeps a [rows, D] accumulator in registers


@dataclass(frozen=True)
class QuantizedKV:
    """One quantized K or V tensor of one layer, exactly as ``kdnctl.kernels.quant.quantize``
    returns it, plus the metadata needed to read it (``shape`` is the dense ``[Hkv, T, D]``)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    fmt: str
    group_size: int
    layout: str
    shape: tuple[int, int, int]

    def __post_init__(self) -> None:
        qref.check_args(self.fmt, self.group_size, self.layout, self.scale.dtype)
        shape = tuple(int(s) for s in self.shape)
        object.__setattr__(self, "shape", shape)
        q_shape, s_shape = qref.out_shapes(shape, self.fmt, self.group_size, self.layout)
        if self.q.dtype != torch.uint8 or self.zero.dtype != self.scale.dtype:
            raise ValueError(f"codes must be uint8 and zero {self.zero.dtype} match scale {self.scale.dtype}")
        if tuple(self.q.shape) != q_shape or tuple(self.scale.shape) != s_shape or self.zero.shape != self.scale.shape:
            raise ValueError(
                f"quantized shapes q{tuple(self.q.shape)} scale{tuple(self.scale.shape)} do not match "
                f"{self.fmt}/{self.layout}/G={self.group_size} for {shape}: expected q{q_shape} scale{s_shape}"
            )

    @classmethod
    def quantize(cls, x: torch.Tensor, fmt: str, group_size: int, layout: str,
                 scale_dtype: torch.dtype = torch.float16) -> "QuantizedKV":
        """Quantize dense ``x [Hkv, T, D]`` (dispatching quant kernels) into this container."""
        from kdnctl.kernels import quant as kq

        q, s, z = kq.quantize(x, fmt, group_size, layout, scale_dtype)
        return cls(q, s, z, fmt, group_size, layout, tuple(x.shape))

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dense(self) -> torch.Tensor:
        """Float32 ``[Hkv, T, D]`` (reference dequantization; for tests and the CPU path)."""
        return qref.dequantize(self.q, self.scale, self.zero, self.fmt, self.group_size,
                               self.layout, self.shape, torch.float32)


def kv_shape(x) -> tuple[int, int, int]:
    return tuple(x.shape) if isinstance(x, QuantizedKV) else tuple(int(s) for s in x.shape)


def check_args(query: torch.Tensor, k, v, bias: torch.Tensor | None):
    """Validate shapes; returns (query as [Hq, Q, D], bias as [Hq, Q, T] view or None, squeeze).

    Shared by both backends so the rules exist once; ``squeeze`` says the caller gave a 2-D
    query and wants a 2-D output back.
    """
    for name, x in (("k", k), ("v", v)):
        if isinstance(x, QuantizedKV):
            continue
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or not x.is_floating_point():
            raise ValueError(f"{name} must be a float [Hkv, T, D] tensor or a QuantizedKV")
    if not query.is_floating_point() or query.dim() not in (2, 3):
        raise ValueError(f"query must be a float [Hq, D] or [Hq, Q, D] tensor, got {tuple(query.shape)}")
    squeeze = query.dim() == 2
    q3 = query[:, None, :] if squeeze else query
    hq, nq, d = q3.shape
    ks, vs = kv_shape(k), kv_shape(v)
    if ks != vs:
        raise ValueError(f"k {ks} and v {vs} must have the same [Hkv, T, D] shape")
    hkv, t, dk = ks
    if dk != d:
        raise ValueError(f"query head_dim {d} != cache head_dim {dk}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{hq} query heads cannot share {hkv} KV heads (GQA needs Hq % Hkv == 0)")
    if d > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} > {MAX_HEAD_DIM} is not supported")
    if bias is not None:
        if not bias.is_floating_point():
            raise ValueError("bias must be a float tensor")
        if tuple(bias.shape) == (hq, t):
            bias = bias[:, None, :].expand(hq, nq, t)  # stride 0 along Q: no copy
        elif tuple(bias.shape) != (hq, nq, t):
            raise ValueError(f"bias {tuple(bias.shape)} must be [Hq, T] = {(hq, t)} or [Hq, Q, T] = {(hq, nq, t)}")
    return q3, bias, squeeze


def default_scale(d: int) -> float:
    return 1.0 / math.sqrt(d)


def _dense(x) -> torch.Tensor:
    return x.dense() if isinstance(x, QuantizedKV) else x.to(torch.float32)


def decode_attention(query: torch.Tensor, k, v, bias: torch.Tensor | None = None, scale: float | None = None, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``[Hq, D]`` (or ``[Hq, Q, D]``) attention of ``query`` over the cached K/V."""
    q3, bias3, squeeze = check_args(query, k, v, bias)
    hq, nq, d = q3.shape
    hkv, t, _ = kv_shape(k)
    scale = default_scale(d) if scale is None else float(scale)
    rep = hq // hkv
    # Dense K/V are materialised here on purpose: this is the readable ground truth, not the
    # fast path. repeat_interleave maps query head h to KV head h // rep.
    kd = _dense(k).repeat_interleave(rep, dim=0)  # [Hq, T, D]
    vd = _dense(v).repeat_interleave(rep, dim=0)
    s = torch.einsum("hqd,htd->hqt", q3.to(torch.float32), kd) * scale
    if bias3 is not None:
        s = s + bias3.to(torch.float32)
    p = torch.softmax(s, dim=-1)
    p = torch.where(torch.isneginf(s).all(dim=-1, keepdim=True), 0.0, p)  # fully masked -> 0
    res = torch.einsum("hqt,htd->hqd", p, vd)
    res = res[:, 0] if squeeze else res
    if out is not None:
        out.copy_(res)
        return out
    return res
