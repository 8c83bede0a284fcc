"""How much an error in each K/V channel moves what attention computes (the ``ec`` weights).

- keys: a key error ``e`` moves the logit of a later query ``q`` by ``q . e``, so channel ``c``
  weighs ``E[q_c^2]`` over the queries of the KV head's group. Measured on the document itself
  (one forward pass, queries before RoPE, like the stored keys). RoPE rotates channel ``c`` with
  its partner ``c + D/2`` by the query-key distance, which the stored key does not know, so the
  two share the mean of their weights.
  Ingest records each chunk's sum of squared queries from its own prefill (bundle tensor
  ``query_energy``), so compressing an ingested version needs no forward for them
  (:func:`recorded_key_weights`).
- values: a value error ``e`` moves the head's output by ``W_o e``; channel ``c`` weighs the
  squared norm of its column of the output projection summed over the group's query heads (weights only).

Both are ``[L, H_kv, D]`` float tensors; :func:`naive_key_weights` is the per-element reference.
"""

from __future__ import annotations

import hashlib
import weakref

import torch

from kdnctl.models import adapter_for


def pair_mean(w: torch.Tensor, rotary_dim: int | None = None) -> torch.Tensor:
    """Mean of each channel's weight with its RoPE partner (rotate-half convention) over the
    first ``rotary_dim`` channels (all by default); channels RoPE leaves alone keep theirs."""
    r = w.shape[-1] if rotary_dim is None else rotary_dim
    if r == w.shape[-1]:
        return (w + w.roll(w.shape[-1] // 2, -1)) / 2
    out = w.clone()
    out[..., :r] = (w[..., :r] + w[..., :r].roll(r // 2, -1)) / 2
    return out


def key_weights(lm, token_ids: list[int], n_layers: int, n_kv_heads: int, head_dim: int,
                rope: bool = True, also=None) -> torch.Tensor:
    """``E[q_c^2]`` per layer, KV head and channel over the document's own queries. A forward
    pass over the whole document: kept per model and document for the process's life, so a
    second budget of the same document (both defaults in one run) does not pay it again.
    ``also(layer, queries [T, Hq, D])`` is called from that pass when this call runs it: a caller
    that needs the document's queries too reads them from the same forward."""
    model = lm.model
    seen = _KEY_WEIGHTS.setdefault(model, {})
    memo = (hashlib.sha256(torch.tensor(token_ids, dtype=torch.int64).numpy().tobytes()).hexdigest(),
            getattr(lm, "fingerprint", None), n_layers, n_kv_heads, head_dim, rope)
    if memo not in seen:
        if len(seen) >= 8:
            seen.clear()
        seen[memo] = _key_weights(lm, token_ids, n_layers, n_kv_heads, head_dim, rope, also)
    return seen[memo].clone()


_KEY_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(tokens, ...): weights}


def forget_key_weights() -> None:
    """Drop the key weights kept so far (a benchmark timing a first compress calls this)."""
    _KEY_WEIGHTS.clear()


def _key_weights(lm, token_ids: list[int], n_layers: int, n_kv_heads: int, head_dim: int, rope: bool,
                 also=None) -> torch.Tensor:
    model = lm.model
    adapter = adapter_for(model)
    out = torch.zeros(n_layers, n_kv_heads, head_dim)

    def on(i, _role, q):
        if also is not None:
            also(i, q)
        q = q.float()  # [T, Hq, D]
        group = q.shape[1] // n_kv_heads
        out[i] = q.view(q.shape[0], n_kv_heads, group, head_dim).pow(2).mean((0, 2)).cpu()

    device = next(model.parameters()).device
    with adapter.capture(("q",), on=on), torch.no_grad():  # the decoder stack alone: no vocabulary logits
        adapter.decoder(torch.tensor([token_ids], device=device), use_cache=False)
    return pair_mean(out, adapter.rotary_dim()) if rope else out


def recorded_key_weights(lm, bundles, n_tokens: int, rope: bool = True) -> torch.Tensor | None:
    """``key_weights`` of a document from the ``query_energy`` its ingest chunks carry (the sum
    of their squared queries over tokens and query heads, from ingest's prefill): the chunks'
    sums over the tokens and query heads they cover. None where a chunk carries none (ingested
    without statistics, before format 1.12, or a compressed version) or the chunks do not cover
    the ``n_tokens`` from the document's first."""
    from kdnctl.format.bundle import QUERY_ENERGY

    sums = [b.tensors.get(QUERY_ENERGY) for b in bundles]
    if not sums or any(e is None for e in sums) or bundles[0].meta.get("token_start") != 0 \
            or sum(int(b.tensors["token_ids"].shape[0]) for b in bundles) != n_tokens:
        return None
    adapter = adapter_for(lm.model)
    total = torch.stack([e.float() for e in sums]).sum(0)  # [L, H_kv, D]
    out = total / (n_tokens * (adapter.n_q_heads // total.shape[1]))
    return pair_mean(out, adapter.rotary_dim()) if rope else out


def value_weights(lm, n_layers: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Squared column norms of the output projection per layer, KV head and channel (summed over the group)."""
    adapter = adapter_for(lm.model)
    out = torch.zeros(n_layers, n_kv_heads, head_dim)
    for i in range(n_layers):
        w = adapter.output_weight(i).detach().float().cpu()  # [hidden, Hq * D]
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
