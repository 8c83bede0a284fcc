"""``kdnctl compress``: a stored version -> a size-budgeted, pruned and/or quantized new version.

Two budgets. ``budget`` (size, the default 0.25): the stored bytes of each document are at most
``budget`` x its fp16 K/V size, everything included; precision fills it (``kdnctl.compress.sizing``'s
tiers, evicting only what the cap forces, or ``quant="ec"``: ``kdnctl.compress.stages``).
``keep`` (token eviction, the meaning ``budget`` had before): the fraction of tokens kept per
layer and KV head.

Per document: load the source chunks, score every token (query-agnostic), let the allocator
split the budget over layers and the press pick kept tokens per layer and KV head over the WHOLE
document, split the picks back into chunks, gather K/V (and any steering bias), quantize, commit
in one transaction. The source stays; the same recipe again is a no-op.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..models import plain_rope_theta
from . import sizing
from .ec import sized_ec
from .recipe import CompressRecipe  # noqa: F401 (re-exported: callers import it from here)
from ..format.bundle import KVBundle, decode_bundle, derived_meta, encode_bundle, stats_of
from ..format.names import tensor_name
from ..errors import UnsupportedError, UsageError
from ..kernels.kvcrush import gather_layers
from ..allocate import allocate
from ..presses.base import ScoreContext
from ..presses.document import select_document
from ..quant import get_quantizer
from ..quant.ladder import LadderQuantizer
from ..scorers.rank import rank01
from ..scorers import compute_importance
from ..store import Store
from ..versions import child_recipe, commit, existing_version, write_derived
from ..quant import layer_kv

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel


@dataclass
class CompressResult:
    doc_id: str
    label: str
    status: str  # "compressed" | "unchanged"
    source_bytes: int = 0
    bytes: int = 0
    seconds: float = 0.0
    score_seconds: float = 0.0
    fp16_bytes: int = 0
    kept: float = 1.0  # fraction of tokens kept (size budget: what the cap forced)
    mix: dict | None = None  # ladder rows per tier, keys and values apart

    @property
    def fraction_of_fp16(self) -> float:
        return self.bytes / self.fp16_bytes if self.fp16_bytes else 0.0

    @property
    def ratio(self) -> float:
        return self.source_bytes / self.bytes if self.bytes else 0.0


def _cat_stats(bundles: list[KVBundle]) -> dict[str, torch.Tensor]:
    per_chunk = [stats_of(b.tensors) for b in bundles]
    names = set.intersection(*(set(s) for s in per_chunk))
    return {n: torch.cat([s[n].float() for s in per_chunk], dim=-1) for n in sorted(names)}


def _attention_stats(lm: LoadedModel, token_ids: list[int], ingest_recipe: dict) -> dict[str, torch.Tensor]:
    """``window`` and ``accum`` of a document computed after the fact (one prefill)."""
    from ..engine.prefill import prefill

    steps = ingest_recipe.get("steps", [ingest_recipe])
    window = int(steps[0].get("window", 32)) if steps else 32
    res = prefill(lm.model, token_ids, stats=("accum", "window"), window=window)
    return {name: t.float() for name, t in res.stats.items()}


def _gather_bias(bias: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """bias [Hq, T] follows the kept tokens of its KV group: idx [Hkv, k] -> [Hq, k]."""
    group = bias.shape[0] // idx.shape[0]
    return torch.gather(bias, 1, idx.repeat_interleave(group, dim=0))


def _importance_mask(importance: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """For mixed precision: kept tokens in the top half of importance (per head) get more bits."""
    vals = torch.gather(importance, 1, idx)
    if vals.shape[1] == 0:
        return torch.zeros_like(vals, dtype=torch.bool)
    return vals >= vals.median(dim=1, keepdim=True).values


def compress_document(store: Store, doc_id: str, recipe: CompressRecipe, *, lm=None, source: str = "full",
                      label: str | None = None, fingerprint: str | None = None) -> CompressResult:
    t0 = time.perf_counter()
    label = label or recipe.default_label()
    done = existing_result(store, doc_id, recipe, source, label)
    if done is not None:
        return done
    src = store.get_version(doc_id, source)
    record, score_s, extra = build_compressed_version(store, src, recipe, label, source, lm=lm, fingerprint=fingerprint,
                                                      with_sizes=True)
    commit(store, record)
    return CompressResult(doc_id, label, "compressed", src.nbytes, record.nbytes, time.perf_counter() - t0, score_s,
                          *extra)


def existing_result(store: Store, doc_id: str, recipe: CompressRecipe, source: str, label: str) -> CompressResult | None:
    """The "unchanged" result when ``label`` already holds this recipe's output (None when it
    must be made); a label made by another recipe is an error."""
    src = store.get_version(doc_id, source)
    done = existing_version(store, doc_id, label, {"source": source, **recipe.as_dict()})
    return CompressResult(doc_id, label, "unchanged", src.nbytes, done.nbytes) if done is not None else None


def build_compressed_version(objects, src, recipe: CompressRecipe, label: str, source: str, *, lm=None,
                             fingerprint: str | None = None, with_sizes: bool = False):
    """Read ``src``'s chunks from ``objects`` (a Store or an ObjectDir), write the new version's
    chunks there and return (its record, not committed; the scorer's seconds)."""
    doc_id = src.doc_id
    step = {"source": source, **recipe.as_dict()}
    bundles = [decode_bundle(objects.read_object(c.object), expect_fingerprint=fingerprint) for c in src.chunks]
    if any("quant" in b.meta for b in bundles):
        raise UnsupportedError(f"{doc_id} [{source}] is already quantized", hint="compress from an unquantized version (e.g. full)", param="source")
    if any("positions" not in b.tensors for b in bundles) and (recipe.keep < 1 or recipe.sized):
        raise UnsupportedError(f"{doc_id} [{source}] is already pruned", hint="compress from an unpruned version (e.g. full)", param="source")
    n_layers = bundles[0].n_layers
    dense = [[layer_kv(b, i) for i in range(n_layers)] for b in bundles]
    keys = [torch.cat([d[i][0] for d in dense], dim=1).float() for i in range(n_layers)]
    values = [torch.cat([d[i][1] for d in dense], dim=1).float() for i in range(n_layers)]
    token_ids = [int(t) for b in bundles for t in b.token_ids.tolist()]
    bounds = [(b.meta["token_start"], b.meta["token_end"]) for b in bundles]
    base = bounds[0][0]
    local_bounds = [(s - base, e - base) for s, e in bounds]
    n_heads = keys[0].shape[0]
    score_s = 0.0
    picks, ctx, press, allocator = None, None, None, None
    lift_w = None
    if recipe.keep < 1 or recipe.sized:
        stats = _cat_stats(bundles)
        press = recipe.build_press(int(bundles[0].meta.get("header_tokens", 0)))
        allocator = recipe.build_allocator()
        if recipe.uses_scorer and recipe.scorer in ("accum", "window") and recipe.scorer not in stats \
                and lm is not None and bounds[0][0] == 0 and src.mode == "prefix":
            stats.update(_attention_stats(lm, token_ids, src.recipe))  # not recorded at ingest
        t_score = time.perf_counter()  # the scorer alone (model passes): reported apart from selection
        importance = compute_importance(recipe.scorer, stats, lm=lm, keys=keys, values=values, token_ids=token_ids,
                                        n_layers=n_layers, n_heads=n_heads) if recipe.uses_scorer \
            else torch.zeros(n_layers, n_heads, len(token_ids))
        if recipe.sized and recipe.lift:  # upgrade weights: the better rank of the two scorers
            lifted = importance if recipe.lift == recipe.scorer and recipe.uses_scorer else \
                compute_importance(recipe.lift, stats, lm=lm, keys=keys, values=values, token_ids=token_ids,
                                   n_layers=n_layers, n_heads=n_heads)  # the same scorer: one model pass
            lift_w = rank01(lifted) if recipe.quant == "ec" else torch.maximum(rank01(importance),
                                                                                       rank01(lifted))
        score_s = time.perf_counter() - t_score
        ctx = ScoreContext(importance=importance, keys=keys, values=values, stats=stats, seed=recipe.seed)
        try:
            if recipe.keep < 1 and not recipe.sized:
                picks = select_document(press, ctx, allocate(allocator, press, ctx, recipe.keep), local_bounds)
        except UnsupportedError as exc:
            # A statistic ingest did not record (``accum`` is opt-in): compute it now from one
            # prefill of the document, when the model is at hand and the version starts at 0.
            if lm is None or "statistic" not in exc.message or bounds[0][0] != 0 or src.mode != "prefix":
                raise UnsupportedError(exc.message, hint="ingest with `--stats all`, or pass --model so compress "
                                       "can compute it") from None
            ctx.stats = {**stats, **_attention_stats(lm, token_ids, src.recipe)}
            picks = select_document(press, ctx, allocate(allocator, press, ctx, recipe.keep), local_bounds)
    else:
        importance = torch.zeros(n_layers, n_heads, len(token_ids))
    fp16 = sizing.fp16_bytes(len(token_ids), n_layers, n_heads, keys[0].shape[-1])
    if recipe.sized:
        # the cap is fitted with the longer of the version's name and its recipe spelled out: what a
        # recipe stores does not depend on the (shorter) name it is given, and any name fits the cap
        fit_label = max(label, recipe.recipe_label(), key=len)
        if recipe.quant == "ec":  # attention-weighted steps, eviction first with --keep (compress/stages/)
            new_tensors, metas, kept, mix = sized_ec(src, fit_label, step, recipe, bundles, keys, values, token_ids,
                                                     local_bounds, fp16, lm, lift_w, importance,
                                                     ctx.stats if ctx is not None else None)
        else:
            new_tensors, metas, kept, mix = _sized(src, fit_label, step, recipe, bundles, dense, keys, values,
                                                   importance if lift_w is None else lift_w, press, allocator, ctx,
                                                   local_bounds, fp16)
        record = write_derived(objects, src, label, step, bundles, new_tensors, meta=metas, indices=range(len(bundles)))
        return (record, score_s, (fp16, kept, mix)) if with_sizes else (record, score_s)
    quantizer = get_quantizer(recipe.quant, group_size=recipe.group_size) if recipe.quant != "none" else None
    new_tensors, metas = [], []
    for c, (b, (ls, le)) in enumerate(zip(bundles, local_bounds)):
        tensors, qmeta = _chunk_tensors(b, dense[c], None if picks is None else picks[c], importance[:, :, ls:le]
                                        if picks is not None else None, quantizer)
        new_tensors.append(tensors)
        metas.append({"quant": qmeta} if qmeta is not None else {})
    record = write_derived(objects, src, label, step, bundles, new_tensors, meta=metas, indices=range(len(bundles)))
    return (record, score_s, (fp16, recipe.keep, None)) if with_sizes else (record, score_s)


def _chunk_tensors(b: KVBundle, dense: list[tuple[torch.Tensor, torch.Tensor]], picks: list[torch.Tensor] | None,
                   importance: torch.Tensor | None, quantizer) -> tuple[dict[str, torch.Tensor], dict | None]:
    """One chunk of the new version: kept K/V (``picks[i]`` = chunk-local kept indices of layer
    i, None = keep all), their positions and steering bias, quantized when ``quantizer``."""
    tensors: dict[str, torch.Tensor] = {"token_ids": b.tensors["token_ids"]}
    qmeta = None
    start = b.meta["token_start"]
    if picks is None:
        if "positions" in b.tensors:
            tensors["positions"] = b.tensors["positions"]
    else:  # one gather launch for all layers' K and one for V (kernel dispatch: Triton on CUDA)
        kept_k = gather_layers([kv[0] for kv in dense], picks)
        kept_v = gather_layers([kv[1] for kv in dense], picks)
    for i, (k, v) in enumerate(dense):
        if picks is not None:
            idx = picks[i]
            k, v = kept_k[i], kept_v[i]
            tensors[tensor_name(i, "positions")] = (idx + start).to(torch.int64)
            mask = _importance_mask(importance[i], idx)
        else:
            if "positions" not in b.tensors:
                tensors[tensor_name(i, "positions")] = b.layer_positions(i)
            idx, mask = None, None
        bias = b.layer(i, "bias")
        if bias is not None:
            tensors[tensor_name(i, "bias")] = _gather_bias(bias.float(), idx).half() if idx is not None else bias
        if quantizer is not None:
            qt, qmeta = quantizer.quantize_layer(k.float(), v.float(), importance=mask)
            tensors.update({tensor_name(i, n): t for n, t in qt.items()})
        else:
            tensors[tensor_name(i, "keys")] = k.contiguous()
            tensors[tensor_name(i, "values")] = v.contiguous()
    return tensors, qmeta


def _doc_rows(picks, local_bounds, n_layers: int, n_tokens: int, n_heads: int) -> list[torch.Tensor]:
    """Per layer, the kept document-level token indices [H, K] (all tokens when picks is None)."""
    if picks is None:
        return [torch.arange(n_tokens).expand(n_heads, n_tokens) for _ in range(n_layers)]
    return [torch.cat([picks[c][i] + ls for c, (ls, _) in enumerate(local_bounds)], dim=1) for i in range(n_layers)]


def _sized(src, label, step, recipe, bundles, dense, keys, values, importance, press, allocator, ctx,
           local_bounds, fp16):
    """Size-budgeted chunks: plan tiers (evicting only if forced), encode exactly as the version
    will be written, and tighten the plan until the bytes fit the cap.
    Returns (tensors per chunk, meta per chunk, kept fraction, tier mix)."""
    n_layers, n_tokens, (n_heads, _, d) = len(keys), keys[0].shape[1], keys[0].shape
    cap = recipe.budget * fp16
    tiers = sizing.ladder_for(recipe.quant)
    if recipe.quant in ("uniform", "floor"):
        pick = sizing.uniform_tier if recipe.quant == "uniform" else sizing.floor_tiers
        tiers = pick(cap - len(bundles) * sizing.HEADER_BYTES - 16 * n_tokens, n_layers * n_heads * n_tokens, d,
                     recipe.group_size)
    rope = bundles[0].meta["model"].get("rope") or {}
    theta = plain_rope_theta(rope)  # None: keys are coded as stored, after RoPE
    q = LadderQuantizer(group_size=recipe.group_size, key_rope_theta=theta, coding=recipe.coding)
    w = sizing.weights(importance)
    if recipe.protect:  # the prompt header and the last tokens: the solver lifts them first
        top = float(w.max()) * 100 if w.numel() else 1.0
        w[..., -recipe.protect:] = top
        w[..., :int(bundles[0].meta.get("header_tokens", 0))] = top
    recipe_meta = child_recipe(src, step)
    # ``fixed``: headers and small tensors (first guess, corrected when even the lowest tier does
    # not fit: then the cap forces eviction); ``margin``: what the planner's byte estimate of the
    # codes missed (an overflow lowers the solver's cap, so upgrades go before any token does)
    fixed, margin = len(bundles) * sizing.HEADER_BYTES + 16 * n_tokens, 0.0
    errors, last_keep, best, loosened, picks = None, None, None, False, None
    for _attempt in range(10):
        forced = sizing.forced_keep(cap - fixed, n_tokens, n_layers, n_heads, d, q.group_size, tiers[-1])
        keep = min(recipe.keep, forced * 0.995 if forced < 1 else 1.0)
        if keep <= 0:
            raise UsageError(f"a budget of {recipe.budget:g} cannot hold even the bundle headers", hint="raise --budget")
        if keep != last_keep:
            picks = select_document(press, ctx, allocate(allocator, press, ctx, keep), local_bounds) if keep < 1 else None
            rows = _doc_rows(picks, local_bounds, n_layers, n_tokens, n_heads)
            kk = [keys[i].gather(1, r[..., None].expand(-1, -1, d)) for i, r in enumerate(rows)]
            vv = [values[i].gather(1, r[..., None].expand(-1, -1, d)) for i, r in enumerate(rows)]
            pos = [r + bundles[0].meta["token_start"] for r in rows]
            imp = [w[i].gather(1, r) for i, r in enumerate(rows)]
            errors, last_keep = None, keep
        pos_bytes = sum(p.numel() for p in pos) * sizing.POSITION_BYTES if picks is not None else 0
        maps, errors = sizing.plan_tiers(q, kk, vv, pos, imp, tiers, cap - fixed - margin - pos_bytes, errors,
                                         key_weight=recipe.key_weight)
        if maps is None:  # even the lowest tier does not fit what is left: evict a little more
            fixed, margin = fixed + max(margin, 0.05 * fixed), 0.0
            continue
        new_tensors, metas, offsets = [], [], [0] * n_layers
        for c, b in enumerate(bundles):
            t, m = _ladder_chunk(b, dense[c], None if picks is None else picks[c], q, maps, offsets)
            new_tensors.append(t)
            metas.append(m)
        total = sum(len(encode_bundle(KVBundle(meta=derived_meta(b.meta, label=label, parent=src.label,
                                                                  recipe=recipe_meta, **m), tensors=t)))
                    for b, t, m in zip(bundles, new_tensors, metas)) + 64 * len(bundles)  # stamp digits
        if total <= cap:
            kept = sum(r.shape[1] for r in rows) / (n_layers * n_tokens)
            best = (new_tensors, metas, kept, sizing.mix(maps))
            if total >= 0.99 * cap or loosened or (len(tiers) == 1 and picks is None):
                return best
            loosened = True  # the estimate was generous: give the slack back once
            if picks is not None and keep < recipe.keep:
                fixed -= (cap - total) * 0.9  # to the tokens the cap evicted
            else:
                margin -= (cap - total) * 0.9  # to the solver's upgrades
            continue
        if best is not None:
            return best
        over = (total - cap) * 1.02 + 64  # what the estimate missed (headers, partial groups, coding)
        lowest = sizing.TIERS.index(tiers[-1])
        at_lowest = all(bool((m == lowest).all()) for pair in maps for m in pair)
        if at_lowest and recipe.quant in ("uniform", "floor") and keep >= recipe.keep and lowest + 1 < len(sizing.TIERS):
            # the best single tier was an estimate and does not fit once encoded: one tier lower
            # for every row beats evicting (eviction only when even the lowest tier does not fit)
            low = sizing.TIERS[lowest + 1]
            tiers = (tiers[-1], low) if recipe.quant == "floor" else (low,)
            errors, margin = None, 0.0
            continue
        if at_lowest:
            # no upgrade left to take back: evict (at least 0.5% of the cap a step: token counts
            # are whole, so a tiny correction may select the same tokens again)
            fixed, margin = fixed + max(over + margin, 0.005 * cap), 0.0
        else:
            margin += over
    if best is not None:
        return best
    raise UsageError(f"could not fit {recipe.budget:g} x the fp16 size", hint="raise --budget")


def _ladder_chunk(b: KVBundle, dense, picks, q: LadderQuantizer, maps, offsets: list[int]):
    """One chunk of a size-budgeted version: kept rows at their planned tiers (``maps[i]`` =
    document-level tier maps of layer i over its kept rows, consumed from ``offsets[i]``)."""
    tensors: dict[str, torch.Tensor] = {"token_ids": b.tensors["token_ids"]}
    start = b.meta["token_start"]
    if picks is None:
        tensors["positions"] = b.tensors["positions"]
    else:
        kept_k = gather_layers([kv[0] for kv in dense], picks)
        kept_v = gather_layers([kv[1] for kv in dense], picks)
    chunk_maps = []
    for i, (k, v) in enumerate(dense):
        idx = None
        if picks is not None:
            idx = picks[i]
            k, v = kept_k[i], kept_v[i]
            p = idx + start  # compact positions (format 1.1): the budget pays for them
            tensors[tensor_name(i, "positions")] = p.to(torch.int16 if (int(p.max()) if p.numel() else 0) < 32768
                                                         else torch.int32)
        bias = b.layer(i, "bias")
        if bias is not None:
            tensors[tensor_name(i, "bias")] = _gather_bias(bias.float(), idx).half() if idx is not None else bias
        n = k.shape[1]
        kt, vt = (m[:, offsets[i]:offsets[i] + n] for m in maps[i])
        offsets[i] += n
        chunk_maps.append((kt, vt))
        p = b.layer_positions(i) if idx is None else idx + start
        tensors.update({tensor_name(i, name): t for name, t in q.encode_layer(k.float(), v.float(), p, kt, vt).items()})
    qmeta = q.meta(dense[0][0].shape[-1])
    qmeta["mix"] = sizing.mix(chunk_maps)  # the bundle records its tier mix: `show` prints it
    return tensors, {"quant": qmeta}
