"""Store: the kept tokens of a recipe without a size budget, each chunk's K/V gathered (and any
steering bias with them) and quantized by the recipe's quantizer (``kdnctl.quant``), or stored
as they are."""

from __future__ import annotations

import torch

from ...format.bundle import KVBundle
from ...format.names import tensor_name
from ...kernels.kvcrush import gather_layers
from ...presses.window_layers import by_window
from ...quant import get_quantizer
from .base import Job, Stage


def gather_bias(bias: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """bias [Hq, T] follows the kept tokens of its KV group: idx [Hkv, k] -> [Hq, k]."""
    group = bias.shape[0] // idx.shape[0]
    return torch.gather(bias, 1, idx.repeat_interleave(group, dim=0))


def importance_mask(importance: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """For mixed precision: kept tokens in the top half of importance (per head) get more bits."""
    vals = torch.gather(importance, 1, idx)
    if vals.shape[1] == 0:
        return torch.zeros_like(vals, dtype=torch.bool)
    return vals >= vals.median(dim=1, keepdim=True).values


def chunk_tensors(b: KVBundle, dense: list[tuple[torch.Tensor, torch.Tensor]], picks: list[torch.Tensor] | None,
                   importance: torch.Tensor | None, quantizer) -> tuple[dict[str, torch.Tensor], dict | None]:
    """One chunk of the new version: kept K/V (``picks[i]`` = chunk-local kept indices of layer
    i, None = keep all), their positions and steering bias, quantized when ``quantizer``."""
    tensors: dict[str, torch.Tensor] = {"token_ids": b.tensors["token_ids"]}
    qmeta = None
    start = b.meta["token_start"]
    if picks is None:
        if "positions" in b.tensors:
            tensors["positions"] = b.tensors["positions"]
    else:  # one gather launch for all layers' K and one for V (kernel dispatch: Triton on CUDA)
        kept_k = gather_layers([kv[0] for kv in dense], picks)
        kept_v = gather_layers([kv[1] for kv in dense], picks)
    for i, (k, v) in enumerate(dense):
        if picks is not None:
            idx = picks[i]
            k, v = kept_k[i], kept_v[i]
            tensors[tensor_name(i, "positions")] = (idx + start).to(torch.int64)
            mask = importance_mask(importance[i], idx)
        else:
            if "positions" not in b.tensors:
                tensors[tensor_name(i, "positions")] = b.layer_positions(i)
            idx, mask = None, None
        bias = b.layer(i, "bias")
        if bias is not None:
            tensors[tensor_name(i, "bias")] = gather_bias(bias.float(), idx).half() if idx is not None else bias
        if quantizer is not None:
            qt, qmeta = quantizer.quantize_layer(k.float(), v.float(), importance=mask)
            tensors.update({tensor_name(i, n): t for n, t in qt.items()})
        else:
            tensors[tensor_name(i, "keys")] = k.contiguous()
            tensors[tensor_name(i, "values")] = v.contiguous()
    return tensors, qmeta


class StoreKept(Stage):
    """Each chunk's tensors and meta (``job.result``; kept share: ``keep``)."""

    name = "store"

    def run(self, job: Job) -> None:
        recipe, importance = job.recipe, job.importance
        picks, window_meta = by_window(recipe, job.bundles[0].meta["model"], job.picks, job.local_bounds, job.n_layers,
                                       job.keys[0].shape[0])
        quantizer = get_quantizer(recipe.quant, group_size=recipe.group_size) if recipe.quant != "none" else None
        new_tensors, metas = [], []
        for c, (b, (ls, le)) in enumerate(zip(job.bundles, job.local_bounds)):
            tensors, qmeta = chunk_tensors(b, job.dense[c], None if picks is None else picks[c],
                                           importance[:, :, ls:le] if picks is not None else None, quantizer)
            new_tensors.append(tensors)
            metas.append({**({"quant": qmeta} if qmeta is not None else {}), **window_meta})
        job.result = (new_tensors, metas, recipe.keep, None)
