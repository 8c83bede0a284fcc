"""How much an error in each K/V channel moves what attention computes (the ``ec`` weights).

- keys: a key error ``e`` moves the logit of a later query ``q`` by ``q . e``, so channel ``c``
  weighs ``E[q_c^2]`` over the queries of the KV head's group. Measured on the document itself
  (one forward pass, queries before RoPE, like the stored keys). RoPE rotates channel ``c`` with
  its partner ``c + D/2`` by the query-key distance, which the stored key does not know, so the
  two share the mean of their weights.
- values: a value error ``e`` moves the head's output by ``W_o e``; channel ``c`` weighs the
  squared norm of its column of ``o_proj`` summed over the group's query heads (weights only).

Both are ``[L, H_kv, D]`` float tensors; :func:`naive_key_weights` is the per-element reference.
"""

from __future__ import annotations

import torch

from kdnctl.errors import UnsupportedError


def attention_modules(model, n_layers: int) -> list:
    """The model's attention modules with ``q_proj``/``o_proj`` (Llama-style), in layer order."""
    mods = [m for _, m in model.named_modules() if hasattr(m, "q_proj") and hasattr(m, "o_proj")]
    if len(mods) != n_layers:
        raise UnsupportedError(f"found {len(mods)} attention modules with q_proj/o_proj, expected {n_layers}",
                               hint="the ec quantizer needs a Llama-style model; use --quant auto")
    return mods


def pair_mean(w: torch.Tensor) -> torch.Tensor:
    """Mean of each channel's weight with its RoPE partner (rotate-half convention)."""
    return (w + w.roll(w.shape[-1] // 2, -1)) / 2


def key_weights(lm, token_ids: list[int], n_layers: int, n_kv_heads: int, head_dim: int,
                rope: bool = True) -> torch.Tensor:
    """``E[q_c^2]`` per layer, KV head and channel over the document's own queries."""
    model = lm.model
    mods = attention_modules(model, n_layers)
    out = torch.zeros(n_layers, n_kv_heads, head_dim)

    def hook(i):
        def f(_mod, _inp, q):
            q = q[0].detach().float()  # [T, Hq * D]
            group = q.shape[-1] // head_dim // n_kv_heads
            out[i] = q.view(q.shape[0], n_kv_heads, group, head_dim).pow(2).mean((0, 2)).cpu()
        return f

    handles = [m.q_proj.register_forward_hook(hook(i)) for i, m in enumerate(mods)]
    try:
        device = next(model.parameters()).device
        with torch.no_grad():  # the decoder stack alone: no logits over the vocabulary
            model.base_model(torch.tensor([token_ids], device=device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return pair_mean(out) if rope else out


def value_weights(lm, n_layers: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Squared column norms of ``o_proj`` per layer, KV head and channel (summed over the group)."""
    out = torch.zeros(n_layers, n_kv_heads, head_dim)
    for i, m in enumerate(attention_modules(lm.model, n_layers)):
        w = m.o_proj.weight.detach().float().cpu()  # [hidden, Hq * D]
        col = w.pow(2).sum(0).view(-1, head_dim)  # [Hq, D]
        out[i] = col.view(n_kv_heads, -1, head_dim).sum(1)
    return out


def naive_key_weights(queries: torch.Tensor, n_kv_heads: int, rope: bool = True) -> torch.Tensor:
    """Reference for one layer: ``queries [T, Hq, D]`` -> ``[H_kv, D]``, element by element."""
    t, hq, d = queries.shape
    group = hq // n_kv_heads
    out = torch.zeros(n_kv_heads, d, dtype=torch.float64)
    for h in range(n_kv_heads):
        for c in range(d):
            acc = 0.0
            for g in range(h * group, (h + 1) * group):
                for i in range(t):
                    acc += float(queries[i, g, c]) ** 2
            out[h, c] = acc / (t * group)
    if rope:
        half = d // 2
        out = torch.stack([(out[:, c] + out[:, (c + half) % d]) / 2 for c in range(d)], dim=1)
    return out.float()
