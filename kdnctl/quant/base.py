"""Shared base of the KV quantizers: argument checks, one-tensor encode/decode, meta layout.

Every quantized tensor ``<name>`` (``keys`` or ``values``, later prefixed ``layers.{i}.`` by the
bundle writer) is stored as:

- ``<name>.q``     uint8 codes (int4: two per byte along the grouped axis; fp8: e4m3 bits)
- ``<name>.scale`` float16 (default) or float32, one per group
- ``<name>.zero``  same dtype/shape as scale
- ``<name>.shape`` int64 ``[3]``: the original ``[H, T, D]`` (required to decode int4/mixed;
  int8/fp8 fall back to the code tensor's shape when it is absent)

``.shape`` makes every tensor self-describing: int4 packing loses the parity of the grouped
length, and pruned bundles keep a different T per layer, so a bundle-wide ``meta["quant"]``
cannot carry per-layer shapes. Decoding therefore needs only the scheme-level meta keys
(``scheme``, ``group_size``, ``layouts``); per-layer keys such as ``shapes`` are informational.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kdnctl.errors import BundleFormatError, InputError, UsageError
from kdnctl.kernels import quant as kq  # dispatching kernels; imports no triton itself

META_VERSION = 1
DEFAULT_LAYOUTS = {"keys": "channel", "values": "token"}
_SCALE_DTYPES = {"float16": torch.float16, "float32": torch.float32}
_F16_MAX = 65504.0


def role_of(prefix: str) -> str:
    """``"layers.3.keys"`` -> ``"keys"``."""
    return prefix.rsplit(".", 1)[-1]


def layout_for(prefix: str, quant_meta: dict) -> str:
    role = role_of(prefix)
    layout = (quant_meta.get("layouts") or {}).get(role) or DEFAULT_LAYOUTS.get(role)
    if layout not in ("channel", "token"):
        raise BundleFormatError(f"no quantization layout known for tensor {prefix!r}")
    return layout


def need(tensors: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return tensors[name]
    except KeyError:
        raise BundleFormatError(f"quantized tensor {name!r} is missing") from None


def stored_shape(tensors: dict[str, torch.Tensor], prefix: str) -> tuple[int, int, int]:
    shape = need(tensors, f"{prefix}.shape")
    if shape.dim() != 1 or shape.numel() != 3 or shape.is_floating_point():
        raise BundleFormatError(f"{prefix}.shape must be an int tensor of 3 values")
    h, t, d = (int(v) for v in shape.tolist())
    if min(h, t, d) < 0:
        raise BundleFormatError(f"{prefix}.shape holds a negative size")
    return h, t, d


def check_kv(keys: torch.Tensor, values: torch.Tensor, scale_dtype: str) -> None:
    """Validate a layer's K/V before quantizing (domain errors, not asserts)."""
    for name, t in (("keys", keys), ("values", values)):
        if t.dim() != 3 or not t.is_floating_point():
            raise InputError(
                f"{name} must be a float [H, T, D] tensor, got {tuple(t.shape)} {t.dtype}",
                hint="pass one layer's keys/values as stored in the KV cache",
            )
        if t.numel() and not bool(torch.isfinite(t).all()):
            raise InputError(f"{name} contain NaN or inf; cannot quantize", hint="re-run ingest")
        # float16 scale/zero cannot hold a group minimum beyond the float16 range.
        if scale_dtype == "float16" and t.numel() and float(t.abs().max()) > _F16_MAX:
            raise UsageError(
                f"{name} reach {float(t.abs().max()):.3g}, beyond float16 scale/zero",
                hint="quantize with scale_dtype='float32'",
            )
    if keys.shape != values.shape:
        raise InputError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} differ")


DEFAULT_GROUP_SIZE = 32  # elements per scale/zero group


@dataclass
class Quantizer:
    """Base: options shared by every scheme. Subclasses set ``name`` and ``quantize_layer``."""

    name: ClassVar[str] = ""
    group_size: int = DEFAULT_GROUP_SIZE
    scale_dtype: str = "float16"
    key_layout: str = "channel"
    value_layout: str = "token"

    def __post_init__(self) -> None:
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or not (
            2 <= self.group_size <= 4096 and self.group_size % 2 == 0
        ):
            raise UsageError(
                f"group_size must be an even int in [2, 4096], got {self.group_size!r}",
                hint="typical values: 32, 64, 128",
            )
        if self.scale_dtype not in _SCALE_DTYPES:
            raise UsageError(
                f"scale_dtype must be one of {sorted(_SCALE_DTYPES)}, got {self.scale_dtype!r}"
            )
        for which in ("key_layout", "value_layout"):
            if getattr(self, which) not in ("channel", "token"):
                raise UsageError(f"{which} must be 'channel' or 'token'")

    @property
    def layouts(self) -> dict[str, str]:
        return {"keys": self.key_layout, "values": self.value_layout}

    def base_meta(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, Any]:
        return {
            "scheme": self.name,
            "version": META_VERSION,
            "group_size": self.group_size,
            "scale_dtype": self.scale_dtype,
            "layouts": self.layouts,
            "shapes": {"keys": list(keys.shape), "values": list(values.shape)},
        }

    def quantize_layer(
        self, keys: torch.Tensor, values: torch.Tensor, *, importance: torch.Tensor | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        raise NotImplementedError

    @classmethod
    def dequantize(
        cls, tensors: dict[str, torch.Tensor], prefix: str, quant_meta: dict
    ) -> torch.Tensor:
        raise NotImplementedError


def encode_tensor(
    x: torch.Tensor, name: str, fmt: str, group_size: int, layout: str, scale_dtype: str
) -> dict[str, torch.Tensor]:
    """One tensor -> ``{name.q, name.scale, name.zero, name.shape}`` (dispatching kernels)."""
    q, s, z = kq.quantize(x, fmt, group_size, layout, _SCALE_DTYPES[scale_dtype])
    return {
        f"{name}.q": q,
        f"{name}.scale": s,
        f"{name}.zero": z,
        f"{name}.shape": torch.tensor(list(x.shape), dtype=torch.int64),
    }


def decode_tensor(
    tensors: dict[str, torch.Tensor],
    name: str,
    fmt: str,
    group_size: int,
    layout: str,
    shape: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`; float32 ``[H, T, D]``. Bad shapes -> BundleFormatError."""
    q, s, z = (need(tensors, f"{name}.{part}") for part in ("q", "scale", "zero"))
    if shape is None:
        # int8/fp8 codes hold the exact shape, so a bundle without `.shape` (optional in
        # docs/bundle-format.md) still decodes; int4 codes lose the parity of the grouped axis.
        has_shape = f"{name}.shape" in tensors
        shape = stored_shape(tensors, name) if has_shape or fmt in ("int4", "int3", "int2") else tuple(q.shape)
    float_scale = s.dtype in (torch.float16, torch.float32)
    if q.dtype != torch.uint8 or not float_scale or z.dtype != s.dtype:
        raise BundleFormatError(
            f"{name}: unexpected dtypes q={q.dtype} scale={s.dtype} zero={z.dtype}"
        )
    q_shape, s_shape = kq.out_shapes(shape, fmt, group_size, layout)
    if tuple(q.shape) != q_shape or tuple(s.shape) != s_shape or tuple(z.shape) != s_shape:
        raise BundleFormatError(
            f"{name}: q{tuple(q.shape)}/scale{tuple(s.shape)} do not fit shape {list(shape)} "
            f"({fmt}, {layout}, group {group_size})"
        )
    return kq.dequantize(q, s, z, fmt, group_size, layout, shape, torch.float32)


def group_size_of(quant_meta: dict) -> int:
    g = quant_meta.get("group_size")
    if not isinstance(g, int) or g < 1:
        raise BundleFormatError(f"quant meta has no valid group_size: {g!r}")
    return g


def bytes_per_element(tensors: dict[str, torch.Tensor], n_elements: int) -> float:
    """Stored bytes (codes + scale/zero + index/shape tensors) per dense element."""
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return total / max(n_elements, 1)


@dataclass
class GroupwiseQuantizer(Quantizer):
    """One format for both K and V (int8 / int4 / fp8); subclasses only set ``fmt``/``bits``."""

    fmt: ClassVar[str] = ""
    bits: ClassVar[int] = 0

    def quantize_layer(self, keys, values, *, importance=None):
        # importance is accepted for interface uniformity; a single-format scheme ignores it.
        check_kv(keys, values, self.scale_dtype)
        tensors: dict[str, torch.Tensor] = {}
        for role, x in (("keys", keys), ("values", values)):
            tensors.update(
                encode_tensor(
                    x, role, self.fmt, self.group_size, self.layouts[role], self.scale_dtype
                )
            )
        meta = self.base_meta(keys, values)
        meta.update(bits=self.bits, format=self.fmt)
        meta["bytes_per_element"] = round(bytes_per_element(tensors, 2 * keys.numel()), 6)
        return tensors, meta

    @classmethod
    def dequantize(cls, tensors, prefix, quant_meta):
        return decode_tensor(
            tensors, prefix, cls.fmt, group_size_of(quant_meta), layout_for(prefix, quant_meta)
        )


def ceil_frac(frac: float, n: int) -> int:
    return min(n, math.ceil(frac * n - 1e-9)) if frac > 0 else 0
