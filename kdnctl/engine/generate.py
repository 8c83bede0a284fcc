"""Generation over a loaded context (or none): the suffix's forward pass and greedy decoding,
with kdnctl's attention, or with the model's own for the full-prefill reference."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..models import adapter_for
from .attention import AttentionState, own_or_kdn_attention
from kdnctl.models.cache_args import cache_arg, cache_out

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

    from .hf import LoadedContext


@dataclass
class GenerationResult:
    answer: str
    token_ids: list[int]
    ttft_s: float
    first_logits: torch.Tensor
    total_s: float


def stop_ids(tokenizer) -> set[int]:
    stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            stops.add(tid)
    return stops


@torch.inference_mode()
def forward_suffix(lm: LoadedModel, ctx: LoadedContext | None, suffix_ids: list[int], *, last_only: bool = False,
                   own_attention: bool = False):
    """Run ``suffix_ids`` after the cached context; returns (logits [q, V], cache).

    ``last_only``: compute the vocabulary projection for the last token only (``[1, V]``):
    all a next-token prediction needs, and the full projection costs more than the layers
    for a short suffix. ``own_attention`` (no context): the model's own attention and cache."""
    from transformers import DynamicCache

    model = lm.model
    start = ctx.next_position if ctx is not None else 0
    cache = ctx.make_cache(model.config) if ctx is not None else \
        DynamicCache(config=model.config) if own_attention else adapter_for(model).full_cache()
    ids = torch.tensor([suffix_ids], device=lm.device)
    pos = torch.arange(start, start + len(suffix_ids), device=lm.device)[None]
    pending = ctx.pending if ctx is not None else None
    with _attention(model, ctx, own_attention), \
            pending.sharing_cores() if pending is not None and lm.device.type == "cpu" else nullcontext():
        out = model(input_ids=ids, **cache_arg(model, cache), position_ids=pos, use_cache=True,
                    logits_to_keep=1 if last_only else 0)
    return out.logits[0].float(), cache_out(out)


def _attention(model, ctx: LoadedContext | None, own: bool):
    return own_or_kdn_attention(model, ctx.attention_state() if ctx is not None else AttentionState(), own)


@torch.inference_mode()
def generate(lm: LoadedModel, ctx: LoadedContext | None, suffix_ids: list[int], *, max_new_tokens: int = 48, t0: float | None = None,
             own_attention: bool = False) -> GenerationResult:
    """Greedy decoding of ``suffix_ids`` after ``ctx`` (None = no cached context).

    ``ttft_s`` counts from ``t0`` (default: now) to the first token's logits, so a caller that
    started its clock before loading the bundles gets load + suffix prefill."""
    t0 = time.perf_counter() if t0 is None else t0
    model = lm.model
    logits, cache = forward_suffix(lm, ctx, suffix_ids, last_only=True, own_attention=own_attention)
    if ctx is not None:
        ctx.settle()  # (the forward waited for every layer; a decode's error is raised here at the latest)
    first_logits = logits[-1]
    nxt = int(first_logits.argmax())  # the first token, and on a GPU the wait for its logits
    ttft = time.perf_counter() - t0
    stops = stop_ids(lm.tokenizer)
    pos = (ctx.next_position if ctx else 0) + len(suffix_ids)
    out_ids: list[int] = []
    with _attention(model, ctx, own_attention):
        while nxt not in stops and len(out_ids) < max_new_tokens:
            out_ids.append(nxt)
            out = model(
                input_ids=torch.tensor([[nxt]], device=lm.device),
                **cache_arg(model, cache),
                position_ids=torch.tensor([[pos]], device=lm.device),
                use_cache=True,
            )
            cache = cache_out(out)
            pos += 1
            nxt = int(out.logits[0, -1].argmax())
    answer = lm.tokenizer.decode(out_ids, skip_special_tokens=True).strip()
    return GenerationResult(answer, out_ids, ttft, first_logits, time.perf_counter() - t0)


def full_prefill_generate(lm: LoadedModel, context_ids: list[int], suffix_ids: list[int], *, max_new_tokens: int = 48) -> GenerationResult:
    """Baseline: no stored KV, prefill context + suffix from scratch with the model's own
    attention implementation (never kdnctl's), so a wrong store cannot agree with itself."""
    t0 = time.perf_counter()
    return generate(lm, None, list(context_ids) + list(suffix_ids), max_new_tokens=max_new_tokens, t0=t0,
                    own_attention=True)
