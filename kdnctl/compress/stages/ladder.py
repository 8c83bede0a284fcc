"""Ladder: a size-budgeted version in per-row tiers (``uniform``, ``floor``, ``ladder``): plan the
tiers by importance (``kdnctl.compress.sizing``), evicting only what the cap forces, encode
exactly as the version will be written, and tighten the plan until the bytes fit the cap."""

from __future__ import annotations

import torch

from ...allocate import allocate
from ...errors import UsageError
from ...format.bundle import KVBundle, derived_meta, encode_bundle
from ...format.names import tensor_name
from ...kernels.kvcrush import gather_layers
from ...models import plain_rope_theta
from ...presses.document import select_document
from ...quant.ladder import LadderQuantizer
from ...versions import child_recipe
from ...presses.window_layers import by_window
from .. import sizing
from .base import Job, Stage
from .plain import gather_bias


def doc_rows(picks, local_bounds, n_layers: int, n_tokens: int, n_heads: int) -> list[torch.Tensor]:
    """Per layer, the kept document-level token indices [H, K] (all tokens when picks is None)."""
    if picks is None:
        return [torch.arange(n_tokens).expand(n_heads, n_tokens) for _ in range(n_layers)]
    return [torch.cat([picks[c][i] + ls for c, (ls, _) in enumerate(local_bounds)], dim=1) for i in range(n_layers)]


def sized_ladder(src, label, step, recipe, bundles, dense, keys, values, importance, press, allocator, ctx,
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
            rows = doc_rows(picks, local_bounds, n_layers, n_tokens, n_heads)
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
            t, m = ladder_chunk(b, dense[c], None if picks is None else picks[c], q, maps, offsets)
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


def ladder_chunk(b: KVBundle, dense, picks, q: LadderQuantizer, maps, offsets: list[int]):
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
            tensors[tensor_name(i, "bias")] = gather_bias(bias.float(), idx).half() if idx is not None else bias
        n = k.shape[1]
        kt, vt = (m[:, offsets[i]:offsets[i] + n] for m in maps[i])
        offsets[i] += n
        chunk_maps.append((kt, vt))
        p = b.layer_positions(i) if idx is None else idx + start
        tensors.update({tensor_name(i, name): t for name, t in q.encode_layer(k.float(), v.float(), p, kt, vt).items()})
    qmeta = q.meta(dense[0][0].shape[-1])
    qmeta["mix"] = sizing.mix(chunk_maps)  # the bundle records its tier mix: `show` prints it
    return tensors, {"quant": qmeta}


class LadderTiers(Stage):
    """Each chunk's tensors and meta at their planned tiers (``job.result``)."""

    name = "ladder"

    def run(self, job: Job) -> None:
        # window_layers=window selects tokens by layer, which tiers do not take: refused in one line
        by_window(job.recipe, job.bundles[0].meta["model"], None, job.local_bounds, job.n_layers, job.keys[0].shape[0])
        job.result = sized_ladder(job.src, job.label, job.step, job.recipe, job.bundles, job.dense, job.keys,
                                  job.values, job.importance if job.lift is None else job.lift, job.press,
                                  job.allocator, job.ctx, job.local_bounds, job.fp16)
