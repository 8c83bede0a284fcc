"""Steering edit ``reprefill``: recompute the document's KV with the steering bias active.

Exact PASTA over the document: the steered heads down-weight the non-highlighted tokens for
EVERY query, the document's own tokens included, so the hidden states and hence the K/V of all
later layers change. The document's tokens (from the source bundles) are prefilled again with
``prefill(..., bias=...)`` (a ``[H_q, T]`` bias per steered layer over all keys), and the new K/V
are stored together with the same bias, which then also applies at decode time.

Sources:

* an unpruned, unquantized version (``full``): every token is re-prefilled and stored; ingest
  statistics are recomputed when the source had them (they observe attention without the bias);
* a pruned version: the full document is re-prefilled and the source's kept positions
  (``layers.{i}.positions``, per layer and KV head) are re-applied to the new K/V;
* a quantized version is refused (the quantizer's choices cannot be replayed on new values):
  steer the unquantized version, then ``kdnctl compress --from`` the steered label;
* a version that already carries a steering bias is refused (reprefill from an unsteered one).
"""

from __future__ import annotations

import torch

from ..format.bundle import stats_of, stats_tensors

from ..format.names import tensor_name
from ..errors import UnsupportedError
from ..engine.prefill import prefill
from ..versions import recipe_steps
from .base import EditContext, SteerEdit, pasta_bias


def _ingest_window(recipe: dict) -> int:
    for step in recipe_steps(recipe):
        if step.get("step") == "ingest" and "window" in step:
            return int(step["window"])
    return 32


class ReprefillEdit(SteerEdit):
    name = "reprefill"

    def apply(self, ctx: EditContext) -> list[dict[str, torch.Tensor]]:
        doc = f"{ctx.doc_id} [{ctx.source.label}]"
        if any(b.is_quantized(i) for b in ctx.bundles for i in range(b.n_layers)):
            raise UnsupportedError(f"{doc} is quantized; reprefill cannot reproduce its quantization",
                                   hint="steer the unquantized version, then `kdnctl compress --from` the steered label")
        if any(n.endswith(".bias") for b in ctx.bundles for n in b.tensors):
            raise UnsupportedError(f"{doc} already carries a steering bias; reprefill starts from an unsteered version",
                                   hint="steer from an unsteered version (e.g. full)", param="source")
        lm, n = ctx.lm, len(ctx.token_ids)
        n_kv = int(lm.summary["n_kv_heads"])
        all_pos = torch.arange(n, dtype=torch.int64)[None].expand(n_kv, n)
        bias = {layer: pasta_bias(ctx.highlight.mask, all_pos, heads, ctx.n_q_heads, ctx.spec.alpha)
                for layer, heads in ctx.spec.heads.items()}
        want_stats = all(stats_of(b.tensors) for b in ctx.bundles)
        res = prefill(lm.model, ctx.token_ids, stats=want_stats, window=_ingest_window(ctx.source.recipe), bias=bias)
        base = int(ctx.bundles[0].meta["token_start"])
        out = []
        for b in ctx.bundles:
            s, e = int(b.meta["token_start"]) - base, int(b.meta["token_end"]) - base
            tensors: dict[str, torch.Tensor] = {"token_ids": b.tensors["token_ids"]}
            if "positions" in b.tensors:
                tensors["positions"] = b.tensors["positions"]
            for i in range(b.n_layers):
                src_k = b.layer(i, "keys")
                pos = b.layer_positions(i)
                idx = (pos - base)[..., None].expand(-1, -1, src_k.shape[-1]).to(res.keys[i].device)
                tensors[tensor_name(i, "keys")] = torch.gather(res.keys[i], 1, idx).to(src_k.dtype).cpu().contiguous()
                tensors[tensor_name(i, "values")] = torch.gather(res.values[i], 1, idx).to(src_k.dtype).cpu().contiguous()
                if b.layer(i, "positions") is not None:
                    tensors[tensor_name(i, "positions")] = b.layer(i, "positions")
                if i in ctx.spec.heads:
                    tensors[tensor_name(i, "bias")] = ctx.layer_bias(b, i).to(torch.float16)
            if want_stats:
                tensors.update(stats_tensors(res.stats, s, e))
            out.append(tensors)
        return out
