"""mixed: important tokens in int8, the rest in int4 (both KIVI layout).

Policy. Per KV head the same number ``k`` of tokens is promoted to int8, so both parts stay
dense ``[H, k, D]`` / ``[H, T-k, D]`` tensors the groupwise kernels take unchanged:

- ``importance`` bool ``[T]`` or ``[H, T]``: the flagged tokens; a head with fewer flags than
  the most-flagged head is topped up with its most outlying unflagged tokens (auto score).
- ``importance`` float ``[T]`` or ``[H, T]``: the ``ceil(important_frac * T)`` highest scores.
- ``importance`` None: the ``ceil(important_frac * T)`` highest auto scores.

Auto score = key outlierness (max over channels of ``|k - mean_t| / std_t``: a token that is
extreme in a channel widens that channel's int4 group range for every token of the group)
plus relative value range (a per-token value group's error grows with its own range).
Both are scaled to [0, 1] per head before adding.

Measured (tests/test_quant.py ``kv_with_outliers``: [3, 256, 64] Gaussian K/V with 3 large,
offset key channels and 8 outlier tokens; group 32, float16 scale/zero; error = relative
Frobenius, mean of K and V): int4 0.071 -> mixed auto (10%) 0.038, while promoting a random 10%
gives 0.065; int8 is 0.004. Size 0.69 B/elem vs int4 0.63 and int8 1.13.

Tensors per role (``keys``/``values``): ``.q/.scale/.zero`` = int4 part (non-important tokens,
in order), ``.hi.q/.hi.scale/.hi.zero`` = int8 part, ``.idx`` int32 ``[H, k]`` = positions of the
important tokens (ascending), ``.shape`` = the full ``[H, T, D]``. Everything needed to rebuild
is in the tensors, so :meth:`dequantize` works per layer even when k differs between layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kdnctl.errors import BundleFormatError, UsageError

from .base import (
    Quantizer,
    bytes_per_element,
    ceil_frac,
    check_kv,
    decode_tensor,
    encode_tensor,
    group_size_of,
    layout_for,
    need,
    stored_shape,
)

HI, LO = "int8", "int4"


def auto_score(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``[H, T]`` outlier score in [0, 2]; higher = more damaged by int4 (see module doc)."""
    k = keys.to(torch.float32)
    v = values.to(torch.float32)
    t = k.shape[1]
    if t == 0:
        return k.new_zeros(k.shape[:2])
    k_z = ((k - k.mean(1, keepdim=True)) / (k.std(1, keepdim=True, unbiased=False) + 1e-6))
    k_score = k_z.abs().amax(-1)  # [H, T]
    v_score = v.amax(-1) - v.amin(-1)  # [H, T]

    def unit(s: torch.Tensor) -> torch.Tensor:
        return s / (s.amax(1, keepdim=True) + 1e-12)

    return unit(k_score) + unit(v_score)


def select_important(
    importance: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor, frac: float
) -> torch.Tensor:
    """Per-head positions of the int8 tokens: int64 ``[H, k]``, ascending."""
    h, t, _ = keys.shape
    score = auto_score(keys, values)
    if importance is None:
        k = ceil_frac(frac, t)
        combined = score
    else:
        imp = importance.to(keys.device)
        if imp.dim() == 1:
            imp = imp.expand(h, -1)
        if tuple(imp.shape) != (h, t):
            raise UsageError(
                f"importance must be [T] or [H, T] = [{h}, {t}], got {tuple(importance.shape)}"
            )
        if imp.dtype == torch.bool:
            k = int(imp.sum(1).max()) if t else 0
            combined = imp.to(torch.float32) * 4.0 + score  # flags first, then auto top-up
        elif imp.is_floating_point():
            k = ceil_frac(frac, t)
            combined = imp.to(torch.float32)
        else:
            raise UsageError(f"importance must be a bool mask or float scores, got {imp.dtype}")
    if k == 0:
        return torch.zeros(h, 0, dtype=torch.int64, device=keys.device)
    idx = combined.topk(k, dim=1).indices
    return idx.sort(dim=1).values


def _rest_index(idx: torch.Tensor, t: int) -> torch.Tensor:
    """Complement of ``idx [H, k]`` within ``range(t)``: ``[H, t - k]``, ascending."""
    h, k = idx.shape
    mask = torch.zeros(h, t, dtype=torch.bool, device=idx.device)
    mask.scatter_(1, idx, True)
    if int(mask.sum()) != h * k:
        raise BundleFormatError("mixed quantization index holds duplicate positions")
    return torch.arange(t, device=idx.device).expand(h, t)[~mask].view(h, t - k)


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.gather(1, idx[..., None].expand(-1, -1, x.shape[2]))


@dataclass
class MixedQuantizer(Quantizer):
    name = "mixed"
    important_frac: float = 0.1

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0.0 <= float(self.important_frac) <= 1.0):
            raise UsageError(f"important_frac must be in [0, 1], got {self.important_frac!r}")

    def quantize_layer(self, keys, values, *, importance=None):
        check_kv(keys, values, self.scale_dtype)
        h, t, d = keys.shape
        idx = select_important(importance, keys, values, self.important_frac)
        rest = _rest_index(idx, t)
        tensors: dict[str, torch.Tensor] = {}
        for role, x in (("keys", keys), ("values", values)):
            layout = self.layouts[role]
            g, sd = self.group_size, self.scale_dtype
            hi = encode_tensor(_take(x, idx), f"{role}.hi", HI, g, layout, sd)
            lo = encode_tensor(_take(x, rest), role, LO, g, layout, sd)
            hi.pop(f"{role}.hi.shape")  # implied by .idx and .shape
            tensors.update(hi)
            tensors.update(lo)
            tensors[f"{role}.shape"] = torch.tensor([h, t, d], dtype=torch.int64)
            tensors[f"{role}.idx"] = idx.to(torch.int32)
        meta = self.base_meta(keys, values)
        meta.update(
            bits=4,
            hi_bits=8,
            important_frac=self.important_frac,
            n_important=int(idx.shape[1]),
            policy="importance" if importance is not None else "auto",
            bytes_per_element=round(bytes_per_element(tensors, 2 * keys.numel()), 6),
        )
        return tensors, meta

    @classmethod
    def dequantize(cls, tensors, prefix, quant_meta):
        g = group_size_of(quant_meta)
        layout = layout_for(prefix, quant_meta)
        h, t, d = stored_shape(tensors, prefix)
        idx = need(tensors, f"{prefix}.idx")
        if idx.dim() != 2 or idx.shape[0] != h or idx.shape[1] > t or idx.is_floating_point():
            raise BundleFormatError(
                f"{prefix}.idx has shape {tuple(idx.shape)} for [{h}, {t}, {d}]"
            )
        idx = idx.to(torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= t):
            raise BundleFormatError(f"{prefix}.idx points outside the {t} tokens")
        k = idx.shape[1]
        rest = _rest_index(idx, t)
        hi = decode_tensor(tensors, f"{prefix}.hi", HI, g, layout, shape=(h, k, d))
        lo = decode_tensor(tensors, prefix, LO, g, layout, shape=(h, t - k, d))
        out = torch.empty(h, t, d, dtype=torch.float32, device=lo.device)
        out.scatter_(1, idx[..., None].expand(-1, -1, d), hi)
        out.scatter_(1, rest[..., None].expand(-1, -1, d), lo)
        return out
