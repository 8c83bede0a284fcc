"""Forward passes that produce a document's KV and the statistics compression needs.

One document = one sequence, run in blocks of ``block_tokens`` queries over a growing cache
(identical to a single pass, but memory stays bounded). In the same pass, through kdnctl's
attention function, we record per layer, per KV head and per token:

* ``window``: mean attention received from the last ``window`` queries of the sequence
  (SnapKV's observation window);
* ``accum``: attention summed over every query (H2O), computed blockwise over query tiles, so
  no full T x T matrix is ever held;
* ``surprisal``: the model's own -log p(token | prefix), from the logits of the same pass.

``bias`` (optional, for steering edits that re-prefill) maps a layer to an additive attention
bias ``[H_q, T]`` over the document's keys; every query of the pass gets it on the keys it can
see (each block passes the first ``e`` columns). The statistics ignore the bias.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch

from .attention import AttentionState, kdn_attention
from ..kernels.vocab import cpu as vocab_cpu, reference as vocab_reference
from ..models import adapter_for
from kdnctl.models.cache_args import cache_arg

QUERY_TILE = 256
# Queries per forward block. One sdpa call over a whole block is the fastest attention (a later
# block must pass an explicit mask over its earlier keys); 8192 tokens keep a block's
# activations around 0.6 GB for this model size while most documents run in a single block.
BLOCK_TOKENS = 8192


def native_bf16(device) -> bool:
    """bf16 matmuls run natively (CUDA, or CPUs with AVX512-BF16/AMX); elsewhere they are
    emulated and slower than fp32."""
    if torch.device(device).type == "cuda":
        return True
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


class SurprisalScorer:
    """-log p(next token) of each position, from the final hidden states.

    The vocabulary projection is most of surprisal's cost (for SmolLM2, 49152 x 576 per token:
    +27% of a forward's FLOPs). The target's own logit is exact (fp32, one weight row per token);
    only the logsumexp over the vocabulary runs in ``dtype`` (bf16 by default where native: ~5x
    faster than fp32 on AVX512-BF16 CPUs; the statistic moves by a few hundredths of a nat, which
    ranking tokens does not notice, see tests/test_stats_reference.py). In fp32 on the host the
    logsumexp runs on numpy's BLAS (``kdnctl.kernels.vocab.cpu``: its matmul 1.3-1.5x the speed
    of torch's on a 2-core AMD EPYC), elsewhere on torch (``kdnctl.kernels.vocab.reference``)."""

    ROW_TILE = 256  # rows per torch projection: a [256, tile] tile of logits at a time
    # vocabulary rows per torch projection on the host, where [256, 2048] logits stay in L2 (bf16 on
    # a 2-core AVX-512 EPYC: 0.72-0.91x the time of 8192-row tiles, research/probes/surprisal_tiles.py);
    # elsewhere the reference's VOCAB_TILE (fewer, larger launches on a GPU)
    HOST_VOCAB_TILE = 2048

    def __init__(self, lm_head, dtype: torch.dtype | None = None):
        weight = lm_head.weight
        if dtype is None:
            dtype = torch.bfloat16 if native_bf16(weight.device) else torch.float32
        self.weight, self.bias = weight, getattr(lm_head, "bias", None)
        self.low = weight if dtype == weight.dtype else _low_copy(weight, dtype)
        self.dtype = dtype
        self.host = dtype == torch.float32 and weight.device.type == "cpu"

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """hidden [m, d] (row i predicts targets[i]) -> surprisal [m] (fp32)."""
        h = hidden.float()
        target = (h * self.weight[targets].float()).sum(-1)
        if self.bias is not None:
            target = target + self.bias[targets].float()
        # -log p(target) = logsumexp(logits) - logit[target]: no log-softmax tensor
        if self.host:
            return vocab_cpu.vocab_logsumexp(h, self.low, self.bias) - target
        x = hidden.to(self.dtype)
        tile = self.HOST_VOCAB_TILE if x.device.type == "cpu" else vocab_reference.VOCAB_TILE
        lse = torch.cat([vocab_reference.vocab_logsumexp(x[s : s + self.ROW_TILE], self.low, self.bias, tile)
                         for s in range(0, x.shape[0], self.ROW_TILE)]) if x.shape[0] else x.new_zeros(0, dtype=torch.float32)
        return lse - target


_LOW: dict[int, tuple] = {}  # id(weight) -> (weakref to it, its version, dtype, low-precision copy)


def _low_copy(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight.to(dtype)``, converted once per weight (56 MB for SmolLM2's vocabulary
    projection: converting it per ingest call cost as much as a short document's statistics)
    and again only if the weight changes in place."""
    import weakref

    for k in [k for k, v in _LOW.items() if v[0]() is None]:  # weights that no longer exist
        del _LOW[k]
    hit = _LOW.get(id(weight))
    if hit is not None and hit[0]() is weight and hit[1] == weight._version and hit[2] == dtype:
        return hit[3]
    low = weight.detach().to(dtype)
    _LOW[id(weight)] = (weakref.ref(weight), weight._version, dtype, low)
    return low


@dataclass
class PrefillResult:
    keys: list[torch.Tensor]  # per layer [H_kv, T, D], post-RoPE
    values: list[torch.Tensor]
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    last_logits: torch.Tensor | None = None
    # per chunk of ``energy_chunk`` tokens [n_chunks, L, H_kv, D]: sum over its tokens and each KV
    # head's query heads of the squared queries (before RoPE); compress's key weights without a forward
    query_energy: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        return self.keys[0].shape[1]


def grouped_probs(q: torch.Tensor, k: torch.Tensor, scaling: float, q_start: int,
                  window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Softmax attention of query tile ``q`` [Hq, b, D] (absolute positions q_start..) over keys
    ``k`` [Hkv, kv, D], returned grouped per KV head as [Hkv, group, b, kv] in fp32; ``window`` and
    ``softcap`` as the model's attention applies them (see kdnctl.engine.attention)."""
    hq, b, d = q.shape
    hkv, kv, _ = k.shape
    g = hq // hkv
    logits = torch.matmul(q.float().reshape(hkv, g * b, d), k.float().transpose(1, 2)) * scaling
    logits = logits.view(hkv, g, b, kv)
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    qpos = torch.arange(q_start, q_start + b, device=q.device)
    future = torch.arange(kv, device=q.device)[None, :] > qpos[:, None]
    if window:
        future |= torch.arange(kv, device=q.device)[None, :] <= qpos[:, None] - window
    logits.masked_fill_(future, float("-inf"))
    return torch.softmax(logits, dim=-1)


ALL_STATS = ("window", "accum", "surprisal")


def stat_names(stats) -> frozenset[str]:
    """``stats`` as given to :func:`prefill`: True = all, False/None = none, or an iterable of names."""
    if stats is True:
        return frozenset(ALL_STATS)
    if not stats:
        return frozenset()
    names = frozenset(stats)
    unknown = sorted(names - set(ALL_STATS))
    if unknown:
        from ..errors import UsageError

        raise UsageError(f"unknown statistic(s) {unknown}", hint=f"choose from {', '.join(ALL_STATS)}")
    return names


class StatsObserver:
    """Accumulates ``accum`` and/or ``window`` statistics from each layer's queries and keys.

    ``window`` alone needs only the last ``window`` queries' attention: a few rows per layer,
    computed beside the model's own attention. ``accum`` needs every query's attention; then
    :meth:`attend` computes the layer's attention output from the SAME probabilities it sums
    (tile by tile), so the pass runs attention once, not twice."""

    def __init__(self, n_layers: int, n_kv_heads: int, n_tokens: int, window: int, device,
                 names=("accum", "window"), query_tile: int = QUERY_TILE):
        self.names = frozenset(names)
        self.query_tile = query_tile
        self.accum = torch.zeros(n_layers, n_kv_heads, n_tokens, device=device) if "accum" in self.names else None
        self.window = torch.zeros(n_layers, n_kv_heads, n_tokens, device=device)
        self.window_size = window
        self.n_tokens = n_tokens

    @property
    def computes_output(self) -> bool:
        return self.accum is not None

    def _tile(self, layer: int, probs: torch.Tensor, past: int, s: int, e: int, kv: int) -> None:
        if self.accum is not None:
            self.accum[layer, :, :kv] += probs.sum(dim=(1, 2))
        lo = max(self.n_tokens - self.window_size - past - s, 0)
        if lo < e - s:
            self.window[layer, :, :kv] += probs[:, :, lo:].sum(dim=(1, 2))

    def _finish(self, layer: int, past: int, b: int, groups: int) -> None:
        if past + b == self.n_tokens:
            self.window[layer] /= groups * min(self.window_size, self.n_tokens)

    def __call__(self, layer: int, query, key, scaling, window: int | None = None, softcap: float | None = None) -> None:
        # Called when the attention function computes the output itself (e.g. with a bias).
        q, k = query[0], key[0]
        b, kv = q.shape[1], k.shape[1]
        past = kv - b
        # window alone: only the last `window` queries' rows are needed
        first = 0 if self.accum is not None else min(max(self.n_tokens - self.window_size - past, 0), b)
        for s in range(first, b, self.query_tile):
            e = min(b, s + self.query_tile)
            self._tile(layer, grouped_probs(q[:, s:e], k, scaling, past + s, window, softcap), past, s, e, kv)
        self._finish(layer, past, b, query.shape[1] // key.shape[1])

    def attend(self, layer: int, query, key, value, scaling) -> torch.Tensor:
        """Attention output [1, Hq, b, D] from tile-wise softmax probabilities, recording stats."""
        q, k, v = query[0], key[0], value[0]
        hq, b, d = q.shape
        hkv, kv, _ = k.shape
        g = hq // hkv
        past = kv - b
        out = torch.empty(hkv, g, b, v.shape[-1], dtype=torch.float32, device=q.device)
        for s in range(0, b, self.query_tile):
            e = min(b, s + self.query_tile)
            probs = grouped_probs(q[:, s:e], k, scaling, past + s)  # [Hkv, g, e-s, kv]
            self._tile(layer, probs, past, s, e, kv)
            out[:, :, s:e] = torch.matmul(probs, v.float()[:, None])
        self._finish(layer, past, b, g)
        return out.reshape(1, hq, b, -1).to(query.dtype)


class QueryEnergy:
    """Per chunk of ``chunk`` tokens, per layer, KV head and channel: the sum of the squared
    queries (before RoPE, after the model's q norm) over the chunk's tokens and the KV head's
    query heads, recorded by a hook on each layer's query projection as the prefill runs. Divided
    by the tokens and heads it sums, it is the key weights (``kdnctl.quant.sensitivity``)."""

    def __init__(self, adapter, n_tokens: int, chunk: int, device=None):
        self.adapter, self.chunk, self.n_kv = adapter, chunk, adapter.n_kv_heads
        # summed where the queries are: one copy to the host at the end, not one per chunk and layer
        self.sums = torch.zeros(-(-n_tokens // chunk), adapter.n_layers, self.n_kv, adapter.head_dim, device=device)
        self.start = 0  # the current block's first token

    def on(self, layer: int, _role: str, q: torch.Tensor) -> None:
        sq = q.float().pow(2)  # [b, Hq, D]
        b = sq.shape[0]
        sq = sq.view(b, self.n_kv, sq.shape[1] // self.n_kv, sq.shape[2]).sum(2)
        for c in range(self.start // self.chunk, -(-(self.start + b) // self.chunk)):
            lo, hi = max(c * self.chunk, self.start) - self.start, min((c + 1) * self.chunk, self.start + b) - self.start
            self.sums[c, layer] += sq[lo:hi].sum(0)

    def capture(self):
        return self.adapter.capture(("q",), on=self.on)


def _block_bounds(n: int, block: int, min_last: int) -> list[tuple[int, int]]:
    bounds = [(s, min(n, s + block)) for s in range(0, n, block)]
    # Keep the observation window inside one block so the last block sees all of it.
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < min_last:
        (a, _), (_, e) = bounds[-2], bounds[-1]
        bounds[-2:] = [(a, e)]
    return bounds


@torch.inference_mode()
def prefill(
    model,
    token_ids: list[int],
    *,
    stats=True,
    window: int = 32,
    block_tokens: int = BLOCK_TOKENS,
    on_progress: Callable[[int], None] | None = None,
    bias: dict[int, torch.Tensor] | None = None,
    query_tile: int = QUERY_TILE,
    surprisal_dtype: torch.dtype | None = None,
    energy_chunk: int | None = None,
) -> PrefillResult:
    """Run ``token_ids`` through ``model`` and return KV (+ statistics when ``stats``).

    ``stats``: True (all of ``window``, ``accum``, ``surprisal``), False, or the names wanted:
    each costs only what it needs (surprisal: the vocabulary projection of every token, in
    tiles; window: the last ``window`` queries' attention; accum: attention from the same pass).
    ``bias``: optional ``{layer: [H_q, T]}`` additive attention bias over the keys (steering).
    ``surprisal_dtype``: precision of the vocabulary projection behind surprisal's logsumexp
    (None: bf16 where the hardware computes it natively, see :class:`SurprisalScorer`).
    ``energy_chunk``: also sum each ``energy_chunk``-token chunk's squared queries
    (``PrefillResult.query_energy``), from the same pass."""
    device = next(model.parameters()).device
    adapter = adapter_for(model)
    n_layers, n_kv = adapter.n_layers, adapter.n_kv_heads
    n = len(token_ids)
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    # every layer keeps every token, sliding-window layers included (stored whole; the attention
    # function applies each layer's window, at prefill and after loading)
    cache = adapter.full_cache()
    names = stat_names(stats)
    attn_names = names & {"window", "accum"}
    observer = StatsObserver(n_layers, n_kv, n, window, device, attn_names, query_tile) if attn_names else None
    want_surprisal = "surprisal" in names
    surprisal = torch.zeros(n, dtype=torch.float32)
    last_logits = None
    lm_head = model.get_output_embeddings()
    scorer = SurprisalScorer(lm_head, surprisal_dtype) if want_surprisal else None
    state = AttentionState(observer=observer)
    energy = QueryEnergy(adapter, n, energy_chunk, device) if energy_chunk else None
    with kdn_attention(model, state), energy.capture() if energy else contextlib.nullcontext():
        for s, e in _block_bounds(n, block_tokens, window):
            if energy:
                energy.start = s
            if bias:
                state.bias = {layer: b[:, :e].to(device) for layer, b in bias.items()}
            out = adapter.decoder(
                input_ids=ids[:, s:e],
                **cache_arg(adapter.decoder, cache),
                use_cache=True,
                position_ids=torch.arange(s, e, device=device)[None],
            )
            hidden = out.last_hidden_state[0]
            if want_surprisal:
                targets = ids[0, s + 1 : e + 1]  # (the block's last row predicts nothing at the end)
                m = len(targets)
                surprisal[s + 1 : s + 1 + m] = scorer(hidden[:m], targets).cpu()
            if e == n:
                last_logits = lm_head(hidden[-1:]).float()[0].cpu()
            if on_progress:
                on_progress(e - s)
    keys = [layer.keys[0].detach().clone() for layer in cache.layers]
    values = [layer.values[0].detach().clone() for layer in cache.layers]
    result = PrefillResult(keys, values, last_logits=last_logits, query_energy=energy.sums.cpu() if energy else None)
    if "window" in names:
        result.stats["window"] = observer.window.cpu()
    if "accum" in names:
        result.stats["accum"] = observer.accum.cpu()
    if want_surprisal:
        result.stats["surprisal"] = surprisal
    return result


@torch.inference_mode()
def reference_stats(model, token_ids: list[int], *, window: int = 32) -> dict[str, torch.Tensor]:
    """The spec of the ingest statistics, naively: one forward over the whole sequence with
    transformers' eager attention, every ``[H_q, T, T]`` attention matrix materialised.

    ``accum[l, g, j]`` = sum over the query heads of KV group g and over every query i of
    ``attn[l, h, i, j]``; ``window`` = the same sum over the last ``window`` queries only,
    divided by (heads per group * min(window, T)); ``surprisal[i]`` = -log p(token_i | tokens
    before i) from the same pass (0 for the first token). Small inputs only (O(T^2) memory)."""
    cfg = model.config
    n_kv = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    previous = cfg._attn_implementation
    cfg._attn_implementation = "eager"
    try:
        out = model(input_ids=ids, output_attentions=True, use_cache=False)
    finally:
        cfg._attn_implementation = previous
    n = len(token_ids)
    accum, win = [], []
    for attn in out.attentions:  # per layer [1, H_q, T, T]
        a = attn[0].float()
        grouped = a.reshape(n_kv, a.shape[0] // n_kv, n, n)  # [H_kv, group, T, T]
        accum.append(grouped.sum(dim=(1, 2)))
        last = grouped[:, :, max(n - window, 0):, :]
        win.append(last.sum(dim=(1, 2)) / (grouped.shape[1] * min(window, n)))
    logp = torch.log_softmax(out.logits[0].float(), dim=-1)
    surprisal = torch.zeros(n, dtype=torch.float32)
    surprisal[1:] = -logp[:-1].gather(1, ids[0, 1:, None])[:, 0].cpu()
    return {"window": torch.stack(win).cpu(), "accum": torch.stack(accum).cpu(), "surprisal": surprisal}


def bare_prefill_seconds(model, token_ids: list[int]) -> float:
    """Time of a plain forward (no statistics), for benchmarks comparing ingest overhead."""
    import time

    device = next(model.parameters()).device
    ids = torch.tensor([token_ids], device=device)
    with torch.inference_mode():
        t = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        if device.type == "cuda":  # the forward is queued, not done, until the device says so
            torch.cuda.synchronize(device)
        return time.perf_counter() - t

