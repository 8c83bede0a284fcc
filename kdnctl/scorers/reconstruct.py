"""``reconstruct``: KVzip's idea, spending offline compute. After the document, ask the model to
repeat it and record, per layer and KV head, the most attention any repeating query pays to each
original token: tokens needed to reproduce the document are the ones answers are made of. Costs
about one extra prefill. ``reference_reconstruct_scores`` is its naive spec."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from .base import Scorer, ScorerInput
from kdnctl.models.cache_args import cache_arg

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

REPEAT_PROMPT = "\n\nRepeat the document above exactly, word for word.\n"


@torch.inference_mode()
def reconstruct_scores(lm: LoadedModel, keys: list[torch.Tensor], values: list[torch.Tensor], token_ids: list[int],
                       *, chunk_tokens: int = 256, on_progress: Callable[[int], None] | None = None) -> torch.Tensor:
    """KVzip-style reconstruction attention, chunked: for each chunk of the document, run
    ``repeat prompt + chunk`` over the document's cache and keep, per key, the max attention
    from those queries. The cache is cropped back after each chunk, so cost ~ one prefill."""
    from ..engine.attention import AttentionState, kdn_attention
    from ..models import adapter_for
    from ..engine.prefill import grouped_probs

    model = lm.model
    device = lm.device
    t = len(token_ids)
    n_layers, h_kv = len(keys), keys[0].shape[0]
    best = torch.zeros(n_layers, h_kv, t, device=device)

    def observer(layer, query, key, scaling, window=None, softcap=None):
        q, k = query[0], key[0]
        b, kv = q.shape[1], k.shape[1]
        probs = grouped_probs(q, k, scaling, kv - b, window, softcap)  # [Hkv, g, b, kv]
        best[layer] = torch.maximum(best[layer], probs[..., :t].amax(dim=(1, 2)))

    adapter = adapter_for(model)
    cache = adapter.full_cache([(k[None].to(device, lm.dtype), v[None].to(device, lm.dtype))
                                for k, v in zip(keys, values)])
    prompt = lm.tokenizer(REPEAT_PROMPT, add_special_tokens=False).input_ids
    with kdn_attention(model, AttentionState(observer=observer)):
        for s in range(0, t, chunk_tokens):
            piece = prompt + list(token_ids[s : s + chunk_tokens])
            ids = torch.tensor([piece], device=device)
            pos = torch.arange(t, t + len(piece), device=device)[None]
            adapter.decoder(input_ids=ids, **cache_arg(adapter.decoder, cache), position_ids=pos, use_cache=True)
            cache.crop(-len(piece))  # back to the document alone (transformers 5: negative = drop)
            if on_progress:
                on_progress(min(chunk_tokens, t - s))
    return best.cpu()


@torch.inference_mode()
def reference_reconstruct_scores(lm: LoadedModel, token_ids: list[int], *, chunk_tokens: int = 256) -> torch.Tensor:
    """The spec of ``reconstruct_scores``, naively: for each chunk, one forward over
    ``document + repeat prompt + chunk`` from scratch with transformers' eager attention; the
    score of document token j in layer l, KV group g is the max over that group's query heads
    and over the chunk's repeat queries (prompt and chunk tokens) of ``attn[l, h, i, j]``, and
    the max over chunks. Small inputs only (O(T^2) memory, no cache reuse)."""
    model = lm.model
    cfg = model.config
    n_kv = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    t = len(token_ids)
    prompt = lm.tokenizer(REPEAT_PROMPT, add_special_tokens=False).input_ids
    best = torch.zeros(cfg.num_hidden_layers, n_kv, t)
    previous = cfg._attn_implementation
    cfg._attn_implementation = "eager"
    try:
        for s in range(0, t, chunk_tokens):
            piece = prompt + list(token_ids[s : s + chunk_tokens])
            ids = torch.tensor([list(token_ids) + piece], device=lm.device)
            out = model(input_ids=ids, output_attentions=True, use_cache=False)
            for layer, attn in enumerate(out.attentions):
                a = attn[0, :, t:, :t].float().cpu()  # repeat queries -> document keys
                per_group = a.reshape(n_kv, a.shape[0] // n_kv, len(piece), t).amax(dim=(1, 2))
                best[layer] = torch.maximum(best[layer], per_group)
    finally:
        cfg._attn_implementation = previous
    return best


class ReconstructScorer(Scorer):
    name = "reconstruct"
    needs_model = True

    def score(self, inputs: ScorerInput) -> torch.Tensor:
        return reconstruct_scores(inputs.lm, inputs.keys, inputs.values, inputs.token_ids)
