"""Engine loader for transformers models: stored bundles -> cache -> generate.

Python API::

    lm = kdnctl.model.load_model()
    store = kdnctl.store.Store(".kdn", create=False)
    ctx = load_document(lm, store, "manual.md", label="full")   # or load_prefix(lm, store, ids)
    result = generate(lm, ctx, question_ids)

Stored keys already carry RoPE for their original positions, so a cache is rebuilt by
concatenating the chunks' K/V per layer. Pruned bundles hold fewer tokens than positions, and
layers may hold different counts (pyramid budgets): new tokens take positions that continue
from the ORIGINAL length, and kdnctl's attention function builds the causal mask per layer from
its own key length. A steering edit's bias follows the kept tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..bundle import KVBundle, decode_bundle
from ..errors import NotFoundError, StoreCorruptError
from ..store import ReadStore, bundle_mismatch
from .attention import AttentionState, kdn_attention


@dataclass
class LoadedContext:
    keys: list[torch.Tensor]  # per layer [1, H_kv, T_l, D]
    values: list[torch.Tensor]
    next_position: int  # first position for new tokens (= original context length)
    token_ids: list[int]  # original context tokens (what a full prefill would run)
    bias: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [H_q, T_l]
    label: str = "full"
    doc_id: str | None = None
    load_s: float = 0.0
    nbytes: int = 0

    @property
    def n_tokens(self) -> int:
        return self.next_position

    @property
    def kept_tokens(self) -> float:
        return sum(k.shape[2] for k in self.keys) / len(self.keys)

    def make_cache(self, config):
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=list(zip(self.keys, self.values)), config=config)


def context_from_bundles(lm, bundles: list[KVBundle], *, label: str = "full", doc_id: str | None = None) -> LoadedContext:
    """Concatenate chunk bundles (in order) into one context for ``lm``."""
    if not bundles:
        raise NotFoundError("no chunks to load")
    device, dtype = lm.device, lm.dtype
    n_layers = bundles[0].n_layers
    keys, values, bias = [], [], {}
    for layer in range(n_layers):
        ks, vs, bs = [], [], []
        for b in bundles:
            k, v = b.layer_kv(layer)
            ks.append(k)
            vs.append(v)
            if b.layer(layer, "bias") is not None:
                bs.append(b.layer(layer, "bias").float())
            elif any(o.layer(layer, "bias") is not None for o in bundles):
                bs.append(torch.zeros(lm.summary["n_q_heads"], k.shape[1]))
        keys.append(torch.cat(ks, dim=1)[None].to(device=device, dtype=dtype))
        values.append(torch.cat(vs, dim=1)[None].to(device=device, dtype=dtype))
        if bs:
            bias[layer] = torch.cat(bs, dim=1).to(device=device, dtype=dtype)
    token_ids: list[int] = []
    for b in bundles:
        token_ids.extend(int(t) for t in b.token_ids.tolist())
    next_position = int(bundles[-1].meta["token_end"])
    return LoadedContext(keys, values, next_position, token_ids, bias, label, doc_id)


def _read_bundles(lm, store: ReadStore, hits) -> tuple[list[KVBundle], int]:
    """Decode the chunks of ``hits`` ((version, chunk) pairs); each bundle's own metadata must
    match the record that points at it (a record aimed at another document's chunk is refused)."""
    bundles, nbytes = [], 0
    for version, ref in hits:
        data = store.read_object(ref.object)
        nbytes += len(data)
        b = decode_bundle(data, expect_fingerprint=lm.fingerprint)
        why = bundle_mismatch(version, ref, b.meta)
        if why:
            raise StoreCorruptError(f"catalog record does not match its bundle: {why}",
                                    hint="run `kdnctl verify`; the version record is damaged or was tampered with")
        bundles.append(b)
    return bundles, nbytes


def load_document(lm, store: ReadStore, doc_id: str, label: str = "full", doc_version: str | None = None) -> LoadedContext:
    """Load every chunk of a stored document version into a context for ``lm``."""
    t = time.perf_counter()
    return load_version(lm, store, store.get_version(doc_id, label, doc_version), t0=t)


def load_version(lm, store: ReadStore, version, *, t0: float | None = None) -> LoadedContext:
    """Load a version record a caller already holds (``load_document`` looks it up)."""
    t = time.perf_counter() if t0 is None else t0
    doc_id, label = version.doc_id, version.label
    if version.fingerprint != lm.fingerprint:
        from ..errors import ModelMismatchError

        raise ModelMismatchError(
            f"{doc_id} [{label}] was made with model {version.fingerprint[:12]}, "
            f"the loaded model is {lm.fingerprint[:12]}"
        )
    try:
        bundles, nbytes = _read_bundles(lm, store, [(version, c) for c in version.chunks])
    except StoreCorruptError as exc:
        # a missing object of a version that is no longer current was reclaimed by gc (after its
        # grace period): the store is healthy, the load was just slower than the grace period
        if "missing" in exc.message and not _still_stored(store, version):
            raise NotFoundError(f"{doc_id} [{label}] changed while it was being loaded (a newer version replaced "
                                "it and gc reclaimed the old one)", hint="retry the load") from None
        raise
    ctx = context_from_bundles(lm, bundles, label=label, doc_id=doc_id)
    ctx.load_s = time.perf_counter() - t
    ctx.nbytes = nbytes
    return ctx


def _still_stored(store: ReadStore, version) -> bool:
    try:
        now = store.get_version(version.doc_id, version.label)
    except NotFoundError:
        return False
    return now.doc_version == version.doc_version and now.chunks == version.chunks


def load_prefix(lm, store: ReadStore, token_ids: list[int], label: str = "full", chunk_tokens: int | None = None):
    """Find the longest stored prefix of ``token_ids`` (prefix hash chain) and load it.

    Returns (context or None, number of matched tokens)."""
    from ..chunking import chain_hashes

    t = time.perf_counter()
    sizes = [chunk_tokens] if chunk_tokens else store.chunk_sizes()
    best: tuple[list, int] = ([], 0)
    for size in sizes:
        refs = []
        for h in chain_hashes(token_ids, size, lm.fingerprint):
            hit = store.lookup_chunk(lm.fingerprint, label, h)
            if hit is None:
                break
            refs.append(hit)
        matched = refs[-1][1].token_end if refs else 0
        if matched > best[1]:
            best = (refs, matched)
    refs, matched = best
    if not refs:
        return None, 0
    bundles, nbytes = _read_bundles(lm, store, refs)
    ctx = context_from_bundles(lm, bundles, label=label)
    ctx.load_s = time.perf_counter() - t
    ctx.nbytes = nbytes
    return ctx, matched


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
def forward_suffix(lm, ctx: LoadedContext | None, suffix_ids: list[int]):
    """Run ``suffix_ids`` after the cached context; returns (logits [q, V], cache)."""
    from transformers import DynamicCache

    model = lm.model
    start = ctx.next_position if ctx is not None else 0
    cache = ctx.make_cache(model.config) if ctx is not None else DynamicCache(config=model.config)
    ids = torch.tensor([suffix_ids], device=lm.device)
    pos = torch.arange(start, start + len(suffix_ids), device=lm.device)[None]
    with kdn_attention(model, AttentionState(bias=dict(ctx.bias) if ctx else {})):
        out = model(input_ids=ids, past_key_values=cache, position_ids=pos, use_cache=True)
    return out.logits[0].float(), out.past_key_values


@torch.inference_mode()
def generate(lm, ctx: LoadedContext | None, suffix_ids: list[int], *, max_new_tokens: int = 48, t0: float | None = None) -> GenerationResult:
    """Greedy decoding of ``suffix_ids`` after ``ctx`` (None = no cached context).

    ``ttft_s`` counts from ``t0`` (default: now) to the first token's logits, so a caller that
    started its clock before loading the bundles gets load + suffix prefill."""
    t0 = time.perf_counter() if t0 is None else t0
    model = lm.model
    logits, cache = forward_suffix(lm, ctx, suffix_ids)
    first_logits = logits[-1]
    ttft = time.perf_counter() - t0
    stops = stop_ids(lm.tokenizer)
    pos = (ctx.next_position if ctx else 0) + len(suffix_ids)
    out_ids: list[int] = []
    nxt = int(first_logits.argmax())
    state = AttentionState(bias=dict(ctx.bias) if ctx else {})
    with kdn_attention(model, state):
        while nxt not in stops and len(out_ids) < max_new_tokens:
            out_ids.append(nxt)
            out = model(
                input_ids=torch.tensor([[nxt]], device=lm.device),
                past_key_values=cache,
                position_ids=torch.tensor([[pos]], device=lm.device),
                use_cache=True,
            )
            cache = out.past_key_values
            pos += 1
            nxt = int(out.logits[0, -1].argmax())
    answer = lm.tokenizer.decode(out_ids, skip_special_tokens=True).strip()
    return GenerationResult(answer, out_ids, ttft, first_logits, time.perf_counter() - t0)


def full_prefill_generate(lm, context_ids: list[int], suffix_ids: list[int], *, max_new_tokens: int = 48) -> GenerationResult:
    """Baseline: no stored KV, prefill context + suffix from scratch."""
    t0 = time.perf_counter()
    return generate(lm, None, list(context_ids) + list(suffix_ids), max_new_tokens=max_new_tokens, t0=t0)
