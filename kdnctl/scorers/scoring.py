"""Query-agnostic importance scorers: which stored tokens will a *future* question need?

At compress time the question is unknown. Each scorer returns ``[L, H_kv, T]`` (higher = keep):

* ``window``      attention from the last W queries of the document (captured at ingest; SnapKV).
* ``accum``       attention received from every later query, divided by how many queries could
                  see the token (plain H2O sums favour early tokens just for being early).
* ``surprisal``   the model's own -log p(token | prefix) at ingest, the same for every head:
                  surprising tokens carry the information a later question asks about.
* ``reconstruct`` KVzip's idea, spending offline compute: after the document, ask the model to
                  repeat it and record, per layer and KV head, the most attention any repeating
                  query pays to each original token. Tokens needed to reproduce the document
                  are the ones answers are made of. Costs about one extra prefill.
* ``sentences``   every token scores the mean surprisal of its sentence (``sentence_scores``):
                  a planted fact is kept whole, its value with the words a question matches.
* ``sentences-local`` per sentence the better of two ranks: its mean surprisal given the whole
                  document (``sentences``) and given only the 64 tokens before it (one extra
                  batched forward): facts stated in a repeated template ("the locker code of
                  the X group is N") are predictable given the document, not where they stand.
                  On the 130 real-text tasks (``research/results/gpu-h100/sentence_window_probe.txt``)
                  the whole-document ranking keeps 10% of multi-fact answers at a 27% token
                  budget, the 64-token one 92% (but 79% of needles, vs 97%).
* ``sentences-gap`` as ``sentences-local``, but the local surprisal is ranked with half the gap
                  between the two surprisals added (given the 64-token window minus given the
                  whole document): how much the document beyond the window predicts the
                  sentence, large for a record in a template the document set up earlier (a
                  table row, the third "port for the X service is N"), small for prose.
* ``literals``    tokens holding a digit first, then the rest of their sentences, then the
                  others, each class by surprisal (``literal_scores``): the values an exact
                  answer copies, an order for ``--lift`` (finer steps), not for eviction.
* ``hybrid``      (default) equal-weight rank-average of ``reconstruct`` and ``surprisal``: the
                  two offline signals. Measured with ``kdnctl eval`` (``bench/compress.py``)
                  against each scorer alone and against an earlier mix that also used
                  ``window`` (reconstruct 0.5, window 0.3, surprisal 0.2): the last-window
                  attention was the worst single scorer; with it dropped (and the prompt
                  header kept) kvcrush at budget 0.25 went from answer NLL 3.57 / KL 0.86 to
                  3.17 / 0.67 (bench/compress.py before and after).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

from typing import Callable

import torch

from ..errors import UsageError
from .rank import rank01

REPEAT_PROMPT = "\n\nRepeat the document above exactly, word for word.\n"
SCORERS = ("window", "accum", "surprisal", "reconstruct", "hybrid", "sentences", "sentences-local", "sentences-gap",
           "literals")
DEFAULT_SCORER = "hybrid"
NEEDS_MODEL = {"reconstruct", "hybrid", "sentences", "sentences-local", "sentences-gap", "literals"}  # sentences, literals: the tokenizer only


def accum_normalised(accum: torch.Tensor) -> torch.Tensor:
    t = accum.shape[-1]
    seen_by = torch.arange(t, 0, -1, dtype=torch.float32)  # token i is visible to T - i queries
    return accum.float() / seen_by


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
            adapter.decoder(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
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


def compute_importance(name: str, stats: dict[str, torch.Tensor], *, lm=None, keys=None, values=None,
                       token_ids=None, n_layers: int, n_heads: int) -> torch.Tensor:
    """The ``[L, H_kv, T]`` importance of scorer ``name`` for one document."""
    if name not in SCORERS:
        raise UsageError(f"unknown scorer {name!r}", hint=f"choose one of {', '.join(SCORERS)}", param="scorer")
    if name in ("window", "accum", "surprisal") or name in NEEDS_MODEL:
        missing = [s for s in ("window", "accum", "surprisal") if s not in stats and (s == name or (name in NEEDS_MODEL - {"reconstruct"} and s == "surprisal"))]
        if missing:
            raise UsageError(
                f"scorer {name!r} needs ingest statistics {missing} that this version lacks",
                hint="re-ingest with statistics, or use the reconstruct scorer", param="scorer",
            )
    if name == "window":
        return stats["window"].float()
    if name == "accum":
        return accum_normalised(stats["accum"])
    if name == "surprisal":
        return stats["surprisal"].float().expand(n_layers, n_heads, -1).clone()
    if name == "sentences" and lm is not None:
        from .sentences import sentence_surprisal, token_texts

        score = sentence_surprisal(stats["surprisal"], token_texts(lm.tokenizer, token_ids))
        return score.expand(n_layers, n_heads, -1).clone()
    if name == "literals" and lm is not None:
        from .literals import literal_scores
        from .sentences import token_texts

        score = literal_scores(stats["surprisal"], token_texts(lm.tokenizer, token_ids))
        return score.expand(n_layers, n_heads, -1).clone()
    if name in ("sentences-local", "sentences-gap") and lm is not None:
        from .sentences import GAP_WEIGHT, local_sentence_scores

        gap_weight = GAP_WEIGHT if name == "sentences-gap" else 0.0
        score = local_sentence_scores(lm, stats["surprisal"], list(token_ids), gap_weight=gap_weight)
        return score.expand(n_layers, n_heads, -1).clone()
    if lm is None:
        needs = "the tokenizer (sentence bounds)" if name in ("sentences", "literals") else "the model"
        raise UsageError(f"scorer {name!r} needs {needs}", hint="give a loaded model (or use the window scorer)", param="model")
    recon = reconstruct_scores(lm, keys, values, token_ids)
    if name == "reconstruct":
        return recon
    surprisal = rank01(stats["surprisal"].float()).expand(n_layers, n_heads, -1)
    return 0.5 * rank01(recon) + 0.5 * surprisal
