"""Compose independently prefilled chunks into one context (RAG-style KV reuse).

An independent chunk (``kdnctl ingest --mode independent``) was prefilled right after the
prompt header, at positions ``header_len .. header_len + n``. To answer over chunks A, B, C we
place header, A, B, C one after another:

1. **Re-rotation.** Stored keys carry RoPE for the position they were prefilled at. RoPE rotates
   each pair of dimensions ``(x_i, x_{i+D/2})`` by ``pos * inv_freq[i]``, and rotations compose
   additively, so ``RoPE(k, p + d) = R(d * inv_freq) RoPE(k, p)``: a stored key moves from its
   stored position to the target one by rotating it by ``delta = target - source``. The
   frequencies are read from the model's rotary embedding module (``inv_freq``, fp32); angles
   are formed in float64 and cos/sin applied in fp32. This is exact only when the rotation
   depends on the position alone: RoPE types ``default``, ``linear`` and ``llama3`` (their
   scaling is folded into a fixed ``inv_freq``, attention_scaling 1.0); anything else
   (dynamic NTK, YaRN with its magnitude scaling, LongRoPE, ...) raises UnsupportedError.
   Values carry no position and are used as stored.

2. **Naive concatenation** (``recompute=0``) stops here: every chunk's KV is what the chunk
   saw on its own, so tokens of chunk 2+ never attended to the chunks before them
   (cross-chunk attention is missing).

3. **Selective recompute** (CacheBlend-style). At a check layer L (default 1) we run the
   composed token sequence fresh through layers 0..L-1 (full causal attention; cheap for a
   couple of layers) and project layer L's K/V. Those fresh K/V are exact for EVERY token and
   replace the stored ones for layers 0..L. The per-token deviation between fresh and
   re-rotated stored K/V at layer L ranks the tokens; the ``recompute`` fraction with the
   largest deviation (among the chunk tokens; the header is always exact) is then run through
   ALL layers again, at its target positions, attending causally to the whole composed cache
   (an explicit position mask via ``AttentionState.query_positions/key_positions``), and its
   fresh K/V are spliced into the cache. ``recompute=1`` recomputes every chunk token, which is
   exactly a full prefill of ``header + chunks``.

The question (suffix) is not part of the returned context; ``kdnctl.engine.hf.generate(lm, ctx,
suffix_ids)`` runs it fresh after position ``ctx.next_position`` as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

import math
import time

import torch

from ..format.bundle import KVBundle
from ..errors import ModelMismatchError, UnsupportedError, UsageError
from ..models import adapter_for
from .attention import AttentionState, kdn_attention
from .hf import LoadedContext
from ..quant import layer_kv
from kdnctl.models.cache_args import cache_arg

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_CHECK_LAYER = 1
RECOMPUTE_BLOCK = 512


def _rotary_module(lm: LoadedModel):
    return adapter_for(getattr(lm, "model", lm)).rotary_module()


def rope_inv_freq(lm: LoadedModel) -> torch.Tensor:
    """The model's RoPE inverse frequencies (fp32, [D/2]); UnsupportedError for RoPE variants
    whose rotation is not a pure function of the position difference."""
    rot = _rotary_module(lm)
    inv = getattr(rot, "inv_freq", None)
    if rot is None or not isinstance(inv, torch.Tensor):
        raise UnsupportedError("this model has no RoPE rotary embedding kdnctl can read; chunks cannot be re-positioned")
    rope_type = str(getattr(rot, "rope_type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedError(
            f"RoPE type {rope_type!r} cannot be re-rotated exactly (supported: {', '.join(SUPPORTED_ROPE_TYPES)})",
            hint="use prefix-mode ingest for this model",
        )
    if float(getattr(rot, "attention_scaling", 1.0)) != 1.0:
        raise UnsupportedError(f"RoPE with attention scaling {rot.attention_scaling} cannot be re-rotated exactly")
    adapter = adapter_for(getattr(lm, "model", lm))
    if adapter.rotary_dim() != adapter.head_dim:
        raise UnsupportedError(f"RoPE rotates {adapter.rotary_dim()} of {adapter.head_dim} channels per head; "
                               "chunks cannot be re-positioned", hint="use prefix-mode ingest for this model")
    return inv.detach().float().cpu()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rerotate_keys(keys: torch.Tensor, delta, inv_freq: torch.Tensor) -> torch.Tensor:
    """Post-RoPE ``keys`` [..., T, D] at positions p -> the same keys at p + delta (fp32).

    ``delta`` is an int or a tensor broadcastable to [..., T]."""
    d = torch.as_tensor(delta, dtype=torch.float64, device=keys.device)
    ang = d[..., None] * inv_freq.to(device=keys.device, dtype=torch.float64)
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    k = keys.float()
    return k * cos + _rotate_half(k) * sin


def _check_bundles(lm: LoadedModel, header: KVBundle, chunks: list[KVBundle]) -> None:
    for b in [header, *chunks]:
        fp = b.meta.get("model_fingerprint")
        if fp != lm.fingerprint:
            raise ModelMismatchError(f"chunk was made with model {str(fp)[:12]}, the loaded model is {lm.fingerprint[:12]}")
    if header.meta.get("mode") != "independent" or header.meta.get("role", "header") != "header":
        raise UsageError("the header bundle is not an independent-mode header")
    hh, hn = header.meta.get("chain_hash"), header.n_tokens
    for b in chunks:
        name = b.meta.get("doc_id", "?")
        if b.meta.get("mode") != "independent":
            raise UsageError(f"chunk {name} is a prefix-mode chunk; only independent chunks can be composed",
                             hint="ingest with `kdnctl ingest --mode independent`")
        if any(k.endswith((".bias", ".narrow")) for k in b.tensors):
            raise UnsupportedError(f"chunk {name} adds an attention bias (a steering edit, or heads masked off evicted "
                                   "tokens); composing such chunks is not supported")
        if b.meta.get("header_hash") not in (None, hh) or int(b.meta["token_start"]) != hn:
            raise UsageError(f"chunk {name} was prefilled after a different prompt header")


def _kept_everywhere(b: KVBundle) -> bool:
    return all(b.layer_len(i) == b.n_tokens for i in range(b.n_layers))


class _StopForward(Exception):
    """Raised by the observer at the check layer: the layers below are all we need."""


def fresh_first_layers(lm: LoadedModel, token_ids: list[int], upto: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Exact K/V ([1, H_kv, N, D]) of layers 0..upto for ``token_ids`` at positions 0..N-1.

    Runs the decoder until layer ``upto`` has written its K/V to the cache (transformers updates
    the cache before calling the attention function, whose observer then stops the pass)."""
    model = lm.model
    adapter = adapter_for(model)
    cache = adapter.full_cache()

    def stop(layer, query, key, scaling, **_):
        if layer == upto:
            raise _StopForward

    ids = torch.tensor([token_ids], device=lm.device)
    pos = torch.arange(len(token_ids), device=lm.device)[None]
    with kdn_attention(model, AttentionState(observer=stop)):
        try:
            adapter.decoder(input_ids=ids, position_ids=pos, **cache_arg(adapter.decoder, cache), use_cache=True)
        except _StopForward:
            pass
    return [(cache.layers[i].keys, cache.layers[i].values) for i in range(upto + 1)]


def token_deviation(fresh: tuple[torch.Tensor, torch.Tensor], stored: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per-token relative K and V deviation [N] between two [1, H_kv, N, D] K/V pairs."""
    out = 0
    for f, s in zip(fresh, stored):
        f, s = f.float(), s.float()
        out = out + (f - s).pow(2).sum(dim=(0, 1, 3)) / f.pow(2).sum(dim=(0, 1, 3)).clamp_min(1e-12)
    return out


def recompute_tokens(lm: LoadedModel, ctx: LoadedContext, selected: torch.Tensor, *, block_tokens: int = RECOMPUTE_BLOCK) -> None:
    """Recompute the K/V of context positions ``selected`` (sorted, int64) through all layers,
    each attending causally (by position) to the whole cache; splices them into ``ctx``."""
    model, device = lm.model, lm.device
    adapter = adapter_for(model)
    n = ctx.next_position
    keep_mask = torch.ones(n, dtype=torch.bool)
    keep_mask[selected] = False
    keep = keep_mask.nonzero()[:, 0]
    kd = keep.to(device)
    cache = adapter.full_cache([(k[:, :, kd], v[:, :, kd]) for k, v in zip(ctx.keys, ctx.values)])
    ids = torch.tensor(ctx.token_ids, dtype=torch.long)
    key_pos = keep
    for s in range(0, len(selected), block_tokens):
        sel = selected[s : s + block_tokens]
        key_pos = torch.cat([key_pos, sel])
        state = AttentionState(query_positions=sel.to(device), key_positions=key_pos.to(device))
        with kdn_attention(model, state):
            adapter.decoder(input_ids=ids[sel][None].to(device), position_ids=sel[None].to(device),
                        **cache_arg(adapter.decoder, cache), use_cache=True)
    order = torch.argsort(key_pos).to(device)
    ctx.keys = [cache.layers[i].keys[:, :, order] for i in range(len(ctx.keys))]
    ctx.values = [cache.layers[i].values[:, :, order] for i in range(len(ctx.values))]


def context_token_ids(header: KVBundle, chunks: list[KVBundle]) -> list[int]:
    ids = [int(t) for t in header.token_ids.tolist()]
    for b in chunks:
        ids.extend(int(t) for t in b.token_ids.tolist())
    return ids


@torch.inference_mode()
def compose(
    lm: LoadedModel,
    chunks: list[KVBundle],
    header_bundle: KVBundle,
    suffix_ids: list[int] | None = None,
    recompute: float = 0.15,
    *,
    check_layer: int = DEFAULT_CHECK_LAYER,
    block_tokens: int = RECOMPUTE_BLOCK,
    info: dict | None = None,
) -> LoadedContext:
    """Place ``header_bundle`` then ``chunks`` (in order) at consecutive positions.

    ``recompute`` in [0, 1] is the fraction of chunk tokens whose K/V are recomputed (0 = naive
    concatenation, 1 = a full prefill). ``suffix_ids`` (the question) only checks that the
    context plus question fit the model's positions; ``generate`` runs it afterwards.
    ``info``, when given, receives what was done (tokens recomputed, timings)."""
    t0 = time.perf_counter()
    if not isinstance(recompute, (int, float)) or not 0.0 <= float(recompute) <= 1.0:
        raise UsageError(f"recompute must be in [0, 1], got {recompute}", param="recompute")
    if not chunks:
        raise UsageError("no chunks to compose")
    inv_freq = rope_inv_freq(lm)
    _check_bundles(lm, header_bundle, chunks)
    n_layers = header_bundle.n_layers
    if not 1 <= check_layer < n_layers:
        raise UsageError(f"check layer must be in [1, {n_layers - 1}], got {check_layer}")
    h = header_bundle.n_tokens
    offsets, n = [], h
    for b in chunks:
        offsets.append(n)
        n += b.n_tokens
    max_pos = lm.summary.get("max_positions")
    total = n + len(suffix_ids or [])
    if max_pos and total > max_pos:
        raise UsageError(f"composed context ({n} tokens) plus question exceeds the model's {max_pos} positions",
                         hint="compose fewer or smaller chunks")
    device, dtype = lm.device, lm.dtype
    keys, values = [], []
    for layer in range(n_layers):
        hk, hv = layer_kv(header_bundle, layer)
        ks, vs = [hk.float()], [hv.float()]
        for b, off in zip(chunks, offsets):
            k, v = layer_kv(b, layer)
            delta = off - int(b.meta["token_start"])  # pruned chunks keep their original spacing
            ks.append(rerotate_keys(k, delta, inv_freq) if delta else k.float())
            vs.append(v.float())
        keys.append(torch.cat(ks, dim=1)[None].to(device=device, dtype=dtype))
        values.append(torch.cat(vs, dim=1)[None].to(device=device, dtype=dtype))
    token_ids = context_token_ids(header_bundle, chunks)
    ctx = LoadedContext(keys, values, n, token_ids, {}, label="composed")
    candidates = n - h
    n_sel = min(candidates, int(math.ceil(float(recompute) * candidates - 1e-9)))
    done = {"recompute": float(recompute), "check_layer": check_layer, "context_tokens": n,
            "header_tokens": h, "chunk_tokens": candidates, "recomputed_tokens": n_sel, "chunks": len(chunks)}
    if n_sel > 0:
        if not all(_kept_everywhere(b) for b in chunks):
            raise UnsupportedError("selective recompute needs unpruned chunks", hint="use recompute 0 (plain concatenation)", param="recompute")
        if n_sel >= candidates:
            selected = torch.arange(h, n)
        else:
            fresh = fresh_first_layers(lm, token_ids, check_layer)
            dev = token_deviation(fresh[check_layer], (keys[check_layer], values[check_layer]))[h:]
            selected = torch.sort(dev.topk(n_sel).indices.cpu() + h).values
            for i, (k, v) in enumerate(fresh):  # exact for every token below and at the check layer
                ctx.keys[i], ctx.values[i] = k, v
            done["max_deviation"] = round(float(dev.max()), 6)
        recompute_tokens(lm, ctx, selected, block_tokens=block_tokens)
    done["compose_s"] = round(time.perf_counter() - t0, 4)
    if info is not None:
        info.update(done)
    return ctx
