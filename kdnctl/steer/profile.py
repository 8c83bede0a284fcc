"""``kdnctl steer profile``: find the (layer, head) pairs whose steering helps most.

PASTA picks heads by steering each one alone on a small task set and keeping those that help.
With 30 layers x 9 query heads that is 270 runs per task, so the profile is coarse-to-fine and
cheap (everything in ``bias`` mode, the KV of each task document is prefilled once):

1. steer each LAYER alone (all its query heads) -> accuracy gain per layer over no steering;
2. steer each query head of the ``top_layers`` best layers alone -> gain per head;
3. evaluate candidate head sets (the k best heads for a few k; the best layer(s) whole) and keep
   the most accurate set (ties -> fewer heads).

All configurations of one task are decoded together as one batch (greedy, ``max_new_tokens``),
each batch row with its own bias, through a small batched variant of kdnctl's attention.
The resulting config is JSON (``heads = [[layer, head], ...]`` plus the profile data) and is what
``--heads auto`` loads for the model whose fingerprint it records.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

import contextlib
import contextvars
import hashlib
import json
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..engine.attention import build_bias_mask
from ..engine.hf import stop_ids
from ..engine.prefill import prefill
from ..ingest.prompting import PromptFormat
from .base import pasta_bias
from .checks import score_check
from .heads import FORMAT, heads_list
from .highlight import find_highlight
from kdnctl.models.cache_args import cache_arg, cache_out

ATTN_NAME = "kdnctl-steer-batch"
_BATCH_BIAS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("kdn_steer_batch_bias", default=None)


def _batch_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """sdpa with causal mask among new queries plus a per-ROW bias {layer: [B, H_q, n_cached]}."""
    bias = (_BATCH_BIAS.get() or {}).get(getattr(module, "layer_idx", 0))
    b, hq, q_len, _ = query.shape
    kv_len = key.shape[2]
    mask = build_bias_mask(None, hq, q_len, kv_len, query.dtype, query.device)
    if bias is not None:
        full = torch.zeros(b, hq, q_len, kv_len, dtype=query.dtype, device=query.device)
        if mask is not None:  # boolean: True = visible
            full.masked_fill_(~mask, float("-inf"))
        full[..., : bias.shape[-1]] += bias.to(query.dtype)[:, :, None, :]
        mask = full
    gqa = hq != key.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=False, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _batched(model, bias: dict[int, torch.Tensor]):
    from transformers import AttentionInterface

    if ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_NAME, _batch_attention)
    token = _BATCH_BIAS.set(bias)
    previous = model.config._attn_implementation
    model.config._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        model.config._attn_implementation = previous
        _BATCH_BIAS.reset(token)


@torch.inference_mode()
def batched_answers(lm: LoadedModel, keys, values, suffix_ids: list[int], biases: list[dict[int, torch.Tensor]],
                    *, max_new_tokens: int = 16) -> list[str]:
    """Greedy answers after one cached context (keys/values per layer [H_kv, n, D]) for several
    steering configurations at once; ``biases[r]`` = {layer: [H_q, n]} of row r."""
    from transformers import DynamicCache

    model, rows = lm.model, len(biases)
    n, n_q = keys[0].shape[1], lm.summary["n_q_heads"]
    layers = sorted(set().union(*biases)) if biases else []
    stacked = {layer: torch.stack([b.get(layer, torch.zeros(n_q, n)) for b in biases]).to(lm.device, lm.dtype)
               for layer in layers}
    cache = DynamicCache(ddp_cache_data=[(k[None].expand(rows, -1, -1, -1).contiguous().to(lm.device),
                                          v[None].expand(rows, -1, -1, -1).contiguous().to(lm.device))
                                         for k, v in zip(keys, values)], config=model.config)
    stops = stop_ids(lm.tokenizer)
    ids = torch.tensor([suffix_ids] * rows, device=lm.device)
    pos = n + len(suffix_ids)
    toks: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    with _batched(model, stacked):
        out = model(input_ids=ids, **cache_arg(model, cache), use_cache=True, logits_to_keep=1,
                    position_ids=torch.arange(n, pos, device=lm.device)[None].expand(rows, -1))
        while True:
            nxt = out.logits[:, -1].argmax(-1).tolist()
            for r in range(rows):
                if not done[r]:
                    if nxt[r] in stops:
                        done[r] = True
                    else:
                        toks[r].append(nxt[r])
                        done[r] = len(toks[r]) >= max_new_tokens
            if all(done):
                break
            out = model(input_ids=torch.tensor(nxt, device=lm.device)[:, None], **cache_arg(model, cache_out(out)),
                        use_cache=True, position_ids=torch.full((rows, 1), pos, device=lm.device))
            pos += 1
    return [lm.tokenizer.decode(t, skip_special_tokens=True).strip() for t in toks]


class _Prepared:
    def __init__(self, lm: LoadedModel, task, fmt):
        ids, _ = fmt.document_ids(lm.tokenizer, task.text)
        res = prefill(lm.model, ids, stats=False)
        self.keys, self.values = res.keys, res.values
        self.mask = find_highlight(lm.tokenizer, fmt, task.text, ids, [task.highlight]).mask
        self.suffix = fmt.question_ids(lm.tokenizer, task.question)
        self.task = task
        self.positions = torch.arange(len(ids))[None].expand(res.keys[0].shape[0], -1)


def _key(heads: dict[int, list[int]]) -> str:
    return json.dumps(heads_list(heads))


def profile_heads(lm: LoadedModel, tasks, *, alpha: float = 0.01, max_new_tokens: int = 16, top_layers: int = 3,
                  on_progress: Callable[[str, int, int], None] | None = None) -> dict:
    """Run the three profiling stages; returns the head config (JSON-able)."""

    t0 = time.perf_counter()
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    n_layers, n_q = lm.summary["n_layers"], lm.summary["n_q_heads"]
    prepared = []
    for i, task in enumerate(tasks):
        prepared.append(_Prepared(lm, task, fmt))
        if on_progress:
            on_progress("prefill", i + 1, len(tasks))
    results: dict[str, list[bool]] = {}

    def run(stage: str, configs: list[dict[int, list[int]]]) -> None:
        configs = [c for c in configs if _key(c) not in results]
        for key in map(_key, configs):
            results[key] = []
        for i, p in enumerate(prepared):
            biases = [{layer: pasta_bias(p.mask, p.positions, hs, n_q, alpha) for layer, hs in c.items()} for c in configs]
            answers = batched_answers(lm, p.keys, p.values, p.suffix, biases, max_new_tokens=max_new_tokens)
            for c, a in zip(configs, answers):
                results[_key(c)].append(score_check(a, p.task.check))
            if on_progress:
                on_progress(stage, i + 1, len(prepared))

    def acc(c: dict[int, list[int]]) -> float:
        ok = results[_key(c)]
        return sum(ok) / len(ok)

    def losses(c: dict[int, list[int]]) -> int:
        return sum(b and not s for b, s in zip(results[_key({})], results[_key(c)]))

    layer_cfg = {layer: {layer: list(range(n_q))} for layer in range(n_layers)}
    run("layers", [{}] + list(layer_cfg.values()))
    base = acc({})
    layer_rank = sorted(range(n_layers), key=lambda l: (-acc(layer_cfg[l]), losses(layer_cfg[l]), l))
    top = layer_rank[:top_layers]
    head_cfg = {(l, h): {l: [h]} for l in top for h in range(n_q)}
    run("heads", list(head_cfg.values()))
    head_rank = sorted(head_cfg, key=lambda lh: (-acc(head_cfg[lh]), losses(head_cfg[lh]), top.index(lh[0]), lh[1]))
    candidates: list[dict[int, list[int]]] = []
    for k in (1, 2, 3, 4, 6, 9, 12, 18):
        if k <= len(head_rank):
            c: dict[int, list[int]] = {}
            for l, h in head_rank[:k]:
                c.setdefault(l, []).append(h)
            candidates.append({l: sorted(hs) for l, hs in sorted(c.items())})
    for j in range(1, min(3, len(top)) + 1):
        candidates.append({l: list(range(n_q)) for l in sorted(top[:j])})
    run("candidates", candidates)
    n_heads = lambda c: sum(len(h) for h in c.values())  # noqa: E731
    chosen = max(candidates, key=lambda c: (acc(c), -losses(c), -n_heads(c)))
    return {
        "format": FORMAT,
        "fingerprint": lm.fingerprint,
        "model": {k: lm.summary[k] for k in ("arch", "n_layers", "n_q_heads", "n_kv_heads", "head_dim")},
        "heads": heads_list(chosen),
        "alpha": alpha,
        "mode": "bias",
        "profile": {
            "n_tasks": len(tasks),
            "tasks_sha256": hashlib.sha256("\n".join(t.id + t.text for t in tasks).encode()).hexdigest()[:16],
            "max_new_tokens": max_new_tokens,
            "baseline_accuracy": round(base, 4),
            "chosen_accuracy": round(acc(chosen), 4),
            "layers": [{"layer": l, "accuracy": round(acc(layer_cfg[l]), 4), "gain": round(acc(layer_cfg[l]) - base, 4),
                        "losses": losses(layer_cfg[l])} for l in range(n_layers)],
            "top_layers": top,
            "heads": [{"layer": l, "head": h, "accuracy": round(acc(head_cfg[(l, h)]), 4),
                       "gain": round(acc(head_cfg[(l, h)]) - base, 4)} for l, h in head_rank],
            "candidates": [{"heads": heads_list(c), "accuracy": round(acc(c), 4)} for c in candidates],
            "seconds": round(time.perf_counter() - t0, 1),
        },
    }


def write_config(config: dict, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    tmp.replace(out)
    return out
