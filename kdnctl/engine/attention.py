"""kdnctl's attention function for transformers models.

transformers looks attention functions up by ``config._attn_implementation``. We register one
named ``kdnctl`` (only when a kdnctl code path asks for it, never at import) and switch a model
to it inside ``kdn_attention(model, state)``. It computes exactly what sdpa computes, plus:

* an additive per-(layer, query head, cached token) bias: steering edits (PASTA) and masking of
  padded slots when layers hold different numbers of tokens (pyramid budgets);
* optional statistics callbacks that see each layer's queries and keys (attention received by
  every token), used at ingest without materialising full attention matrices.

Because a name unknown to transformers' mask registry gets no mask at all, this function builds
the causal mask itself: the ``q_len`` new queries are the last positions of the key sequence.
When ``AttentionState.query_positions`` and ``key_positions`` are set, the mask is built from
those explicit positions instead (query i sees key j iff ``key_positions[j] <= query_positions[i]``),
which lets a pass recompute tokens that sit in the MIDDLE of a cached context (kdnctl.engine.independent).

Layers whose module passes a ``sliding_window`` or a ``softcap`` get them exactly as the model's
own attention applies them: a query at position p sees keys at positions > p - window (positions
relative to the end of the key sequence, or the explicit ones), and logits are capped to
``softcap * tanh(logits / softcap)`` before the mask and the softmax.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels.attention import decode_attention
from ..kernels.dispatch import use_triton

ATTN_NAME = "kdnctl"
_QUERY_ROWS = 1024
_STATE: contextvars.ContextVar["AttentionState | None"] = contextvars.ContextVar("kdn_attention_state", default=None)


@dataclass
class AttentionState:
    # layer -> [H_q, n_cached] additive bias over the first n_cached keys (None = no bias).
    bias: dict[int, torch.Tensor] = field(default_factory=dict)
    # Called as observer(layer_idx, query [B,Hq,q,D], key [B,Hkv,kv,D], scaling) before attention.
    observer: Callable | None = None
    # Optional explicit positions, int64 [q_len] and [kv_len] (same for every layer). Unset (the
    # default) keeps the "new queries are the last keys" causal mask.
    query_positions: torch.Tensor | None = None
    key_positions: torch.Tensor | None = None
    # Optional per-layer positions of the cached keys (int64 [n_cached]) for sliding-window layers
    # of a context that holds fewer keys than positions; keys after them continue from
    # ``next_position``.
    layer_positions: dict[int, torch.Tensor] = field(default_factory=dict)
    next_position: int = 0


def _register() -> None:
    from transformers import AttentionInterface

    if ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_NAME, kdn_attention_forward)


def build_bias_mask(
    bias: torch.Tensor | None, n_heads: int, q_len: int, kv_len: int, dtype, device
) -> torch.Tensor | None:
    """Mask for sdpa: causal among the new queries plus the cached-token bias, as a float mask
    [1, Hq, q_len, kv_len]; without a bias a boolean [1, 1, q_len, kv_len] (sdpa's fused CPU
    kernel takes it, ~1.5x faster than a per-head float mask at 1k x 4k)."""
    if bias is None and q_len == 1:
        return None
    if bias is None:  # causal only: one boolean mask shared by every head (True = visible)
        visible = torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=device)
        visible[..., kv_len - q_len :] = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
        return visible
    mask = torch.zeros(1, n_heads, q_len, kv_len, dtype=dtype, device=device)
    if q_len > 1:
        past = kv_len - q_len
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=device).triu(1)
        mask[..., past:].masked_fill_(causal, float("-inf"))
    if bias is not None:
        n = bias.shape[-1]
        mask[..., :n] += bias.to(dtype=dtype, device=device)[None, :, None, :]
    return mask


def build_position_mask(
    query_positions: torch.Tensor, key_positions: torch.Tensor, bias: torch.Tensor | None,
    n_heads: int, dtype, device,
) -> torch.Tensor:
    """Float mask [1, Hq or 1, q_len, kv_len]: key j visible to query i iff kpos[j] <= qpos[i],
    plus the cached-token bias over the first keys."""
    qpos = query_positions.to(device=device)
    kpos = key_positions.to(device=device)
    hidden = kpos[None, :] > qpos[:, None]
    mask = torch.zeros(1, 1, qpos.shape[0], kpos.shape[0], dtype=dtype, device=device)
    mask.masked_fill_(hidden, float("-inf"))
    if bias is not None:
        mask = mask.expand(1, n_heads, -1, -1).clone()
        n = bias.shape[-1]
        mask[..., :n] += bias.to(dtype=dtype, device=device)[None, :, None, :]
    return mask


def model_attention(query, key, value, scaling: float, query_positions: torch.Tensor, key_positions: torch.Tensor,
                    window: int | None = None, softcap: float | None = None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """Attention ``[B, q, Hq, D]`` as a model computes it with a sliding window and/or logit
    soft-capping: key j visible to query i iff ``kpos[j] <= qpos[i]`` and (with a window)
    ``kpos[j] > qpos[i] - window``; ``bias`` [Hq, n] adds to the first n keys' logits."""
    qpos = query_positions.to(query.device)
    kpos = key_positions.to(query.device)
    hidden = kpos[None, :] > qpos[:, None]
    if window:
        hidden |= kpos[None, :] <= qpos[:, None] - window
    hq, hkv = query.shape[1], key.shape[1]
    if hkv != hq:
        key = key.repeat_interleave(hq // hkv, dim=1)
        value = value.repeat_interleave(hq // hkv, dim=1)
    out = []
    for s in range(0, query.shape[2], _QUERY_ROWS):  # query rows per step: memory rows x keys
        e = min(query.shape[2], s + _QUERY_ROWS)
        logits = torch.matmul(query[:, :, s:e], key.transpose(2, 3)) * scaling
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        if bias is not None:
            n = bias.shape[-1]
            logits[..., :n] += bias.to(dtype=logits.dtype, device=logits.device)[None, :, None, :]
        logits = logits.masked_fill(hidden[s:e], float("-inf"))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
        out.append(torch.matmul(probs, value))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous()


def _positions(state: "AttentionState | None", layer: int, q_len: int, kv_len: int):
    if state is not None and state.query_positions is not None:
        return state.query_positions, state.key_positions
    stored = state.layer_positions.get(layer) if state is not None else None
    if stored is not None:
        extra = torch.arange(state.next_position, state.next_position + kv_len - stored.shape[0])
        kpos = torch.cat([stored.to(torch.long).cpu(), extra])
    else:
        kpos = torch.arange(kv_len)
    return kpos[kv_len - q_len:], kpos


def kdn_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    state = _STATE.get()
    layer = getattr(module, "layer_idx", 0)
    bias = state.bias.get(layer) if state is not None else None
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if window or softcap:
        q_len, kv_len = query.shape[2], key.shape[2]
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        if state is not None and state.observer is not None and state.query_positions is None:
            state.observer(layer, query, key, scaling, window=window, softcap=softcap)
        qpos, kpos = _positions(state, layer, q_len, kv_len)
        if kpos.shape[0] != kv_len or qpos.shape[0] != q_len:
            raise ValueError(f"layer {layer}: positions cover {qpos.shape[0]} queries / {kpos.shape[0]} keys, "
                             f"attention has {q_len} / {kv_len}")
        return model_attention(query, key, value, scaling, qpos, kpos, window, softcap, bias), None
    if state is not None and state.observer is not None:
        attend = getattr(state.observer, "attend", None)
        if attend is not None and bias is None and state.query_positions is None \
                and getattr(state.observer, "computes_output", False):
            # statistics from the same attention pass: the observer returns the output too
            return attend(layer, query, key, value, scaling).transpose(1, 2).contiguous(), None
        state.observer(layer, query, key, scaling)
    q_len, kv_len = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if state is not None and state.query_positions is not None:
        qp, kp = state.query_positions, state.key_positions
        if kp is None or qp.shape[0] != q_len or kp.shape[0] != kv_len:
            raise ValueError(
                f"layer {layer}: explicit positions cover {qp.shape[0]} queries / "
                f"{None if kp is None else kp.shape[0]} keys, attention has {q_len} / {kv_len}"
            )
        mask = build_position_mask(qp, kp, bias, query.shape[1], query.dtype, query.device)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    if q_len == 1 and query.shape[0] == 1 and use_triton(query, key):
        # A decode step on CUDA: kdnctl's Triton decode kernel (GQA + bias over the cached
        # tokens) via the kernel dispatch layer. On CPU, sdpa below computes the same thing as
        # the kernel's torch reference (tests/test_kernels_attention.py) and is faster there.
        full_bias = None
        if bias is not None:
            full_bias = torch.zeros(query.shape[1], kv_len, dtype=torch.float32, device=query.device)
            full_bias[:, : bias.shape[-1]] = bias.to(device=query.device, dtype=torch.float32)
        out = decode_attention(query[0, :, 0], key[0], value[0], full_bias, scaling)
        return out.to(query.dtype)[None, None], None
    if bias is None and (q_len == 1 or q_len == kv_len):
        out = F.scaled_dot_product_attention(
            query, key, value, is_causal=q_len > 1, scale=scaling, enable_gqa=gqa
        )
    else:
        mask = build_bias_mask(bias, query.shape[1], q_len, kv_len, query.dtype, query.device)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def kdn_attention(model, state: AttentionState):
    """Run ``model`` with kdnctl attention and ``state`` for the duration of the block."""
    _register()
    token = _STATE.set(state)
    previous = model.config._attn_implementation
    model.config._attn_implementation = ATTN_NAME
    try:
        yield state
    finally:
        model.config._attn_implementation = previous
        _STATE.reset(token)


def own_or_kdn_attention(model, state: AttentionState, own: bool):
    """The model's own attention implementation (``own``, the reference a store is compared
    with) or kdnctl's with ``state``."""
    return contextlib.nullcontext() if own else kdn_attention(model, state)
