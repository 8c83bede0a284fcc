"""none: no quantization. Tensors keep the dense names ``keys``/``values`` (the bundle's dense
contract), so a bundle made with it needs no ``meta["quant"]`` at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Quantizer, check_kv, need


@dataclass
class NoneQuantizer(Quantizer):
    name = "none"

    def quantize_layer(self, keys, values, *, importance=None):
        check_kv(keys, values, "float32")
        meta = self.base_meta(keys, values)
        meta.update(bits=torch.finfo(keys.dtype).bits, group_size=None, layouts=None)
        return {"keys": keys, "values": values}, meta

    @classmethod
    def dequantize(cls, tensors, prefix, quant_meta):
        return need(tensors, prefix).to(torch.float32)
