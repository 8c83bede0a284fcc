"""Steering edit ``bias``: keep the stored K/V, add the PASTA attention bias.

Every chunk keeps all its tensors (dense or quantized K/V, positions, statistics) byte for byte;
for each steered layer a ``layers.{i}.bias`` float16 ``[H_q, T_i]`` is added that follows the
tokens the layer actually holds (``bundle.layer_positions(i)``: a pruned bundle's kept tokens, a
query head using its GQA group's positions). Unsteered layers get no bias tensor. A source that
is already steered keeps its bias and the new one is added on top (edits stack).

At decode time kdnctl's attention adds the bias to the logits of the cached tokens, for the
question's tokens and every generated token; the document's own K/V are unchanged, so this is
PASTA applied to the queries that come after the cache.
"""

from __future__ import annotations

import torch

from ..format.names import tensor_name
from .base import EditContext, SteerEdit


class PastaBiasEdit(SteerEdit):
    name = "bias"

    def apply(self, ctx: EditContext) -> list[dict[str, torch.Tensor]]:
        out = []
        for b in ctx.bundles:
            tensors = dict(b.tensors)
            for layer in ctx.spec.heads:
                name = tensor_name(layer, "bias")
                bias = ctx.layer_bias(b, layer)
                if name in tensors:
                    bias = bias + tensors[name].float()
                tensors[name] = bias.to(torch.float16)
            out.append(tensors)
        return out
