"""``kdnctl compress``: a stored version -> a size-budgeted, pruned and/or quantized new version.

Two budgets. ``budget`` (size, the default 0.25): the stored bytes of each document are at most
``budget`` x its fp16 K/V size, everything included; the precision ladder fills it (every token
kept at the best tiers that fit, ``kdnctl.sizing``), and tokens are evicted (by the press) only
when the cap forces it after every row is at the lowest tier. ``keep`` (token eviction, the
meaning ``--budget`` had before): the fraction of tokens kept per layer and KV head.

Per document: load the source chunks, score every token with a query-agnostic scorer, let the
press pick kept tokens per layer and KV head over the WHOLE document (so the budget can go to
the chunks that need it), split the picks back into chunks (every head of a layer keeps the
same count within a chunk), gather K/V (and any steering bias), quantize, and commit the new
version in one transaction. The source version stays; re-running the same recipe is a no-op.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .bundle import KVBundle, decode_bundle, encode_bundle, make_meta
from .errors import UnsupportedError, UsageError
from .kernels.kvcrush import gather_layers
from .presses import get_press
from .presses.allocate import select_document
from .presses.base import ScoreContext, validate_budget
from .quant import get_quantizer
from .quant.ladder import LadderQuantizer
from .scoring import DEFAULT_SCORER, NEEDS_MODEL, compute_importance
from . import sizing
from .store import ChunkRef, Store, VersionRecord


@dataclass
class CompressRecipe:
    """``budget``: size cap as a fraction of the fp16 K/V bytes (None: no cap, pure eviction);
    ``keep``: fraction of tokens kept per layer and KV head by ``method``; ``quant``: with a
    budget, the tiers the ladder may use (``ladder`` = all, ``int4`` = uniform int4, ``fp16`` =
    eviction alone); without one, the quantizer of every kept token (``none``, ``int8``, ...)."""

    budget: float | None = 0.25
    method: str = "kvcrush"
    scorer: str = DEFAULT_SCORER
    quant: str | None = None
    group_size: int = 32
    seed: int = 0
    method_options: dict[str, Any] = field(default_factory=dict)
    keep: float = 1.0

    def __post_init__(self) -> None:
        self.keep = validate_budget(self.keep)
        if self.budget is not None:
            self.budget = validate_budget(self.budget)
            if self.quant is None:
                self.quant = "uniform"
            sizing.ladder_for(self.quant)
        elif self.quant is None:
            self.quant = "none"

    @property
    def sized(self) -> bool:
        return self.budget is not None

    def as_dict(self) -> dict:
        return {"step": "compress", "budget": self.budget, "keep": self.keep, "method": self.method,
                "scorer": self.scorer, "quant": self.quant, "group_size": self.group_size, "seed": self.seed,
                "method_options": dict(sorted(self.method_options.items()))}

    def default_label(self) -> str:
        if self.sized:
            label = f"{self.quant}-b{self.budget:g}"
            if self.method != "kvcrush":
                label = f"{self.method}-{label}"
            if self.keep < 1:
                label += f"-k{self.keep:g}"
        else:
            label = f"{self.method}-k{self.keep:g}" if self.keep < 1 else "k1"
        if self.scorer != DEFAULT_SCORER:
            label += f"-{self.scorer}"
        if not self.sized and self.quant != "none":
            label += f"-{self.quant}"
        return label

    @property
    def uses_scorer(self) -> bool:
        """The scorer ranks tokens for presses that use it, weighs the ladder's damage, and picks
        int8 tokens for ``mixed``."""
        if self.sized and self.quant == "ladder":
            return True
        if self.sized and self.keep == 1 and not sizing.may_evict(self.budget, self.quant, self.group_size):
            return False  # one tier that fits everywhere: nothing to rank
        return self.quant == "mixed" or get_press(self.method, **self.method_options).uses_importance

    @property
    def needs_model(self) -> bool:
        may_prune = self.keep < 1 or self.sized
        return may_prune and self.scorer in NEEDS_MODEL and self.uses_scorer


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
    names = set.intersection(*(set(n[6:] for n in b.tensors if n.startswith("stats.")) for b in bundles))
    return {n: torch.cat([b.tensors[f"stats.{n}"].float() for b in bundles], dim=-1) for n in sorted(names)}


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
    src = store.get_version(doc_id, source)
    existing = {v.label: v for v in store.list_versions(doc_id)}
    full_recipe = {"source": source, **recipe.as_dict()}
    if label in existing:
        if existing[label].recipe.get("steps", [existing[label].recipe])[-1] == full_recipe:
            return CompressResult(doc_id, label, "unchanged", src.nbytes, existing[label].nbytes)
        raise UsageError(f"label {label!r} of {doc_id} was made by another recipe", hint="pass --label NAME")
    bundles = [decode_bundle(store.read_object(c.object), expect_fingerprint=fingerprint) for c in src.chunks]
    if any("quant" in b.meta for b in bundles):
        raise UnsupportedError(f"{doc_id} [{source}] is already quantized", hint="compress from an unquantized version (--from full)")
    if any("positions" not in b.tensors for b in bundles) and (recipe.keep < 1 or recipe.sized):
        raise UnsupportedError(f"{doc_id} [{source}] is already pruned", hint="compress from an unpruned version (--from full)")
    n_layers = bundles[0].n_layers
    dense = [[b.layer_kv(i) for i in range(n_layers)] for b in bundles]
    keys = [torch.cat([d[i][0] for d in dense], dim=1).float() for i in range(n_layers)]
    values = [torch.cat([d[i][1] for d in dense], dim=1).float() for i in range(n_layers)]
    token_ids = [int(t) for b in bundles for t in b.token_ids.tolist()]
    bounds = [(b.meta["token_start"], b.meta["token_end"]) for b in bundles]
    base = bounds[0][0]
    local_bounds = [(s - base, e - base) for s, e in bounds]
    n_heads = keys[0].shape[0]
    score_s = 0.0
    press = ctx = None
    if recipe.keep < 1 or recipe.sized:
        stats = _cat_stats(bundles)
        press = get_press(recipe.method, **recipe.method_options)
        t_score = time.perf_counter()  # the scorer alone (model passes): reported apart from selection
        importance = compute_importance(recipe.scorer, stats, lm=lm, keys=keys, values=values, token_ids=token_ids,
                                        n_layers=n_layers, n_heads=n_heads) if recipe.uses_scorer \
            else torch.zeros(n_layers, n_heads, len(token_ids))
        score_s = time.perf_counter() - t_score
        ctx = ScoreContext(importance=importance, keys=keys, values=values, stats=stats, seed=recipe.seed)
        header = int(bundles[0].meta.get("header_tokens", 0))
        if header > press.sink_tokens:
            # The prompt header (system prompt, start of the user turn) precedes every question
            # and is where attention sinks live: it is always kept, as the press's sinks.
            press = get_press(recipe.method, **{**recipe.method_options, "sink_tokens": header})
    else:
        importance = torch.zeros(n_layers, n_heads, len(token_ids))
    parent_recipe = src.recipe if "steps" in src.recipe else {"steps": [src.recipe]}
    version_recipe = {"steps": parent_recipe["steps"] + [full_recipe]}
    common = dict(bundles=bundles, dense=dense, bounds=bounds, local_bounds=local_bounds, label=label,
                  source=source, version_recipe=version_recipe, importance=importance)
    mix, kept = None, recipe.keep
    if recipe.sized:
        datas, mix, kept, fp16 = _encode_sized(recipe, press, ctx, keys, values, **common)
    else:
        picks = select_document(press, ctx, recipe.keep, local_bounds) if recipe.keep < 1 else None
        datas = _encode_chunks(recipe, picks, None, **common)
        fp16 = sizing.fp16_bytes(len(token_ids), n_layers, n_heads, keys[0].shape[-1])
    chunks, total = [], 0
    for c, data in enumerate(datas):
        sha = store.put_object(data)
        chunks.append(ChunkRef(c, sha, bounds[c][0], bounds[c][1], bundles[c].meta["chain_hash"], len(data)))
        total += len(data)
    record = VersionRecord(doc_id, src.doc_version, label, source, version_recipe, src.fingerprint, chunks,
                           time.time(), src.n_tokens, src.mode)
    store.commit_version(record)
    return CompressResult(doc_id, label, "compressed", src.nbytes, total, time.perf_counter() - t0, score_s,
                          fp16, kept, mix)


def _doc_rows(picks, local_bounds, n_layers: int, n_tokens: int, n_heads: int) -> list[torch.Tensor]:
    """Per layer, the kept document-level token indices [H, K] (all tokens when picks is None)."""
    if picks is None:
        return [torch.arange(n_tokens).expand(n_heads, n_tokens) for _ in range(n_layers)]
    return [torch.cat([picks[c][i] + ls for c, (ls, _) in enumerate(local_bounds)], dim=1) for i in range(n_layers)]


def _encode_sized(recipe: CompressRecipe, press, ctx, keys, values, **common):
    """Size-budgeted encoding: plan tiers (evicting only if forced), encode, and tighten the
    plan until the encoded bytes fit the cap. Returns (datas, mix, kept fraction, fp16 bytes)."""
    bundles, local_bounds = common["bundles"], common["local_bounds"]
    n_layers, n_tokens, (n_heads, _, d) = len(keys), keys[0].shape[1], keys[0].shape
    fp16 = sizing.fp16_bytes(n_tokens, n_layers, n_heads, d)
    cap = recipe.budget * fp16
    tiers = sizing.ladder_for(recipe.quant)
    if recipe.quant == "uniform":
        tiers = sizing.uniform_tier(cap - len(bundles) * sizing.HEADER_BYTES - 16 * n_tokens,
                                    n_layers * n_heads * n_tokens, d, recipe.group_size)
    rope = bundles[0].meta["model"].get("rope") or {}
    theta = rope.get("rope_theta") if rope.get("rope_type", "default") == "default" else None
    q = LadderQuantizer(group_size=recipe.group_size, key_rope_theta=theta, coding="zlib")
    w = sizing.weights(common["importance"])
    fixed = len(bundles) * sizing.HEADER_BYTES + 16 * n_tokens
    keep, errors, last_keep, best, loosened = recipe.keep, None, None, None, False
    for _attempt in range(6):
        forced = sizing.forced_keep(cap - fixed, n_tokens, n_layers, n_heads, d, q.group_size, tiers[-1])
        keep = min(recipe.keep, forced * 0.995 if forced < 1 else 1.0)
        if keep <= 0:
            raise UsageError(f"a budget of {recipe.budget:g} cannot hold even the bundle headers",
                             hint="raise --budget")
        if keep != last_keep:
            picks = select_document(press, ctx, keep, local_bounds) if keep < 1 else None
            rows = _doc_rows(picks, local_bounds, n_layers, n_tokens, n_heads)
            kk = [keys[i].gather(1, r[..., None].expand(-1, -1, d)) for i, r in enumerate(rows)]
            vv = [values[i].gather(1, r[..., None].expand(-1, -1, d)) for i, r in enumerate(rows)]
            pos = [r + bundles[0].meta["token_start"] for r in rows]
            imp = [w[i].gather(1, r) for i, r in enumerate(rows)]
            errors, last_keep = None, keep
        pos_bytes = sum(p.numel() for p in pos) * sizing.POSITION_BYTES if picks is not None else 0
        maps, errors = sizing.plan_tiers(q, kk, vv, pos, imp, tiers, cap - fixed - pos_bytes, errors)
        if maps is None:  # the fixed part grew: evict a little more
            fixed *= 1.05
            continue
        datas = _encode_chunks(recipe, picks, (q, maps), **common)
        total = sum(len(x) for x in datas)
        if total <= cap:
            kept = sum(r.shape[1] for r in rows) / (n_layers * n_tokens)
            best = (datas, sizing.mix(maps), kept, fp16)
            if total >= 0.99 * cap or loosened:
                return best
            loosened = True  # the first guess of the fixed part was generous: give the slack back once
            fixed -= (cap - total) * 0.9
            continue
        if best is not None:
            return best
        fixed += (total - cap) * 1.02 + 64  # what the estimate missed (headers, partial groups)
    if best is not None:
        return best
    raise UsageError(f"could not fit {recipe.budget:g} x the fp16 size", hint="raise --budget")


def _encode_chunks(recipe: CompressRecipe, picks, ladder, *, bundles, dense, bounds, local_bounds, label,
                   source, version_recipe, importance) -> list[bytes]:
    """Encoded bundles of the new version, one per chunk. ``ladder`` = (quantizer, per-layer
    document-level tier maps over the kept rows) for a size-budgeted version."""
    n_layers = len(dense[0])
    quantizer = None
    if ladder is None and recipe.quant != "none":
        quantizer = get_quantizer(recipe.quant, group_size=recipe.group_size)
    offsets = [0] * n_layers
    out = []
    for c, (b, (ls, le)) in enumerate(zip(bundles, local_bounds)):
        tensors: dict[str, torch.Tensor] = {"token_ids": b.tensors["token_ids"]}
        qmeta, chunk_maps = None, []
        if picks is None:
            if "positions" in b.tensors:
                tensors["positions"] = b.tensors["positions"]
        else:  # one gather launch for all layers' K and one for V (kernel dispatch: Triton on CUDA)
            kept_k = gather_layers([kv[0] for kv in dense[c]], picks[c])
            kept_v = gather_layers([kv[1] for kv in dense[c]], picks[c])
        for i in range(n_layers):
            k, v = dense[c][i]
            if picks is not None:
                idx = picks[c][i]
                k, v = kept_k[i], kept_v[i]
                pos = idx + bounds[c][0]
                if ladder is not None:  # compact positions (format 1.1): the budget pays for them
                    pos = pos.to(torch.int16 if (int(pos.max()) if pos.numel() else 0) < 32768 else torch.int32)
                else:
                    pos = pos.to(torch.int64)
                tensors[f"layers.{i}.positions"] = pos
                imp = importance[i][:, ls:le]
                mask = _importance_mask(imp, idx)
            else:
                if "positions" not in b.tensors:
                    tensors[f"layers.{i}.positions"] = b.layer_positions(i)
                idx, mask = None, None
            bias = b.tensors.get(f"layers.{i}.bias")
            if bias is not None:
                tensors[f"layers.{i}.bias"] = _gather_bias(bias.float(), idx).half() if idx is not None else bias
            if ladder is not None:
                q, maps = ladder
                n = k.shape[1]
                kt, vt = (m[:, offsets[i]:offsets[i] + n] for m in maps[i])
                chunk_maps.append((kt, vt))
                offsets[i] += n
                p = b.layer_positions(i) if idx is None else (idx + bounds[c][0])
                qt = q.encode_layer(k.float(), v.float(), p, kt, vt)
                qmeta = q.meta(k.shape[-1])
                tensors.update({f"layers.{i}.{n_}": t for n_, t in qt.items()})
            elif quantizer is not None:
                qt, qmeta = quantizer.quantize_layer(k.float(), v.float(), importance=mask)
                tensors.update({f"layers.{i}.{n}": t for n, t in qt.items()})
            else:
                tensors[f"layers.{i}.keys"] = k.contiguous()
                tensors[f"layers.{i}.values"] = v.contiguous()
        meta = make_meta(**{k: v for k, v in b.meta.items() if k not in ("format_version", "created", "tool_version", "quant")})
        meta.update(label=label, parent=source, recipe=version_recipe)
        if qmeta is not None:
            meta["quant"] = qmeta
            if chunk_maps:  # the bundle records its tier mix (rows per tier): `show` prints it
                meta["quant"]["mix"] = sizing.mix(chunk_maps)
        out.append(encode_bundle(KVBundle(meta=meta, tensors=tensors)))
    return out
