"""KV-cache quantizers (KIVI layout: keys grouped per channel along T, values per token along D).

``get_quantizer(name, **opts).quantize_layer(keys, values, importance=None)`` returns
``(tensors, meta)``: tensors named by relative suffix (``keys.q``, ``keys.scale``, ``keys.zero``,
``keys.shape``, same for ``values``, plus ``.hi.*``/``.idx`` for ``mixed``) and a JSON-able meta.
``dequantize_tensors(tensors, prefix, quant_meta)`` rebuilds one dense float32 tensor, e.g.
prefix ``"layers.3.keys"`` from ``layers.3.keys.q`` etc.; it needs only the scheme-level meta
keys (scheme, group_size, layouts), so one ``meta["quant"]`` serves every layer of a bundle.
See ``base.py`` for the tensor format and ``kdnctl.kernels.quant.reference`` for the numerics.
"""

from __future__ import annotations

import torch

from kdnctl.errors import BundleFormatError, UsageError
from kdnctl.format.names import tensor_name

from .base import Quantizer, bytes_per_element
from .entropy import EntropyQuantizer
from .fp8 import Fp8Quantizer
from .int2 import Int2Quantizer
from .int3 import Int3Quantizer
from .int4 import Int4Quantizer
from .ladder import LadderQuantizer
from .int8 import Int8Quantizer
from .mixed import MixedQuantizer
from .none import NoneQuantizer

QUANTIZERS: dict[str, type[Quantizer]] = {
    "none": NoneQuantizer,
    "int8": Int8Quantizer,
    "int4": Int4Quantizer,
    "int3": Int3Quantizer,
    "int2": Int2Quantizer,
    "fp8": Fp8Quantizer,
    "mixed": MixedQuantizer,
    "ladder": LadderQuantizer,
    "ec": EntropyQuantizer,
}

__all__ = ["layer_kv", 
    "QUANTIZERS",
    "Quantizer",
    "bytes_per_element",
    "dequantize_tensors",
    "get_quantizer",
]


def get_quantizer(name: str, **opts) -> Quantizer:
    """Quantizer instance by registry name; unknown names/options -> UsageError."""
    cls = QUANTIZERS.get(name)
    if cls is None:
        raise UsageError(
            f"unknown quantization scheme {name!r}", hint=f"choose one of {', '.join(QUANTIZERS)}"
        )
    try:
        return cls(**opts)
    except TypeError as exc:  # unexpected keyword
        raise UsageError(f"bad option for quantizer {name!r}: {exc}") from None


def dequantize_tensors(
    tensors: dict[str, torch.Tensor], prefix: str, quant_meta: dict
) -> torch.Tensor:
    """Dense float32 ``[H, T, D]`` for ``prefix`` (e.g. ``"layers.3.keys"``)."""
    scheme = quant_meta.get("scheme") if isinstance(quant_meta, dict) else None
    cls = QUANTIZERS.get(scheme)  # type: ignore[arg-type]
    if cls is None:
        raise BundleFormatError(f"unknown quantization scheme {scheme!r} in bundle meta")
    return cls.dequantize(tensors, prefix, quant_meta)


def layer_kv(bundle, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense (keys, values) of a bundle's layer i, each [H_kv, T_i, D]; dequantizes if needed."""
    if not 0 <= i < bundle.n_layers:
        raise IndexError(f"layer {i} out of range (bundle has {bundle.n_layers} layers)")
    if not bundle.is_quantized(i):
        return bundle.tensors[tensor_name(i, "keys")], bundle.tensors[tensor_name(i, "values")]
    q = bundle.meta["quant"]
    k = dequantize_tensors(bundle.tensors, tensor_name(i, "keys"), q)
    v = dequantize_tensors(bundle.tensors, tensor_name(i, "values"), q)
    dt = getattr(torch, str(bundle.meta.get("dtype", "")), None)
    if isinstance(dt, torch.dtype) and dt.is_floating_point:
        k, v = k.to(dt), v.to(dt)
    return k, v
