"""Size-budgeted chunks in the entropy-coded ``ec`` layout (``kdnctl compress --quant ec``).

Every token is kept, unless ``--keep K`` evicts first: then one set of tokens, the same in every
layer and KV head (the top ``K`` of the scorer's importance averaged over layers and heads, the
prompt header and the last ``protect`` tokens always among them; with the ``sentences`` scorer,
whole sentences), is kept and quantized. Each channel's step follows from how much attention depends on it
(``kdnctl.quant.sensitivity``: query energy for keys, the output projection's column norms for values) and
one scale per document is fitted so the encoded bundles fill the byte cap
(``kdnctl.allocate.rate``); with ``layers="fisher"`` (the default where every token is kept)
each layer's and role's steps are first scaled by how much its error costs the model
(``kdnctl.allocate.layer_fisher``); ``key_weight`` W makes every key step ``1/sqrt(W)`` of its
value-relative size. The prompt header and the last ``protect`` tokens are
quantized ``2**PROTECT_LEVEL`` times finer (``--protect-level``): they precede every question. With ``backfill``
("A-B", opt-in) layers A..B also keep the evicted tokens, ``2**backfill_shift`` times coarser
(the keys ``2**backfill_key_shift`` where it is set: per-role levels). Where ``backfill`` names
KV heads of a layer ("18.2") only those read the evicted tokens: the layer holds every token
(``layers.i.levels``), its other heads code their kept rows only (format 1.8: ``layers.i.narrow``
marks them, the chunk's ``kept`` the tokens), their evicted rows decode to the chunk's mean, and
readers mask their query heads off those rows (``KVBundle.layer_bias``).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from ..models import plain_rope_theta
from ..allocate import layer_fisher as lf
from ..allocate.rate import clamp_steps, fit_near, fit_scale, relative_steps, step_floor
from ..format.bundle import KVBundle, derived_meta, encode_bundle, held_rows, tensor_name
from ..format.kept import kept_positions_dtype
from .recipe import LIFT_LEVEL, LIFT_SHARE, PROTECT_LEVEL
from ..errors import UsageError
from ..quant.basis import basis_for_model, load_basis
from ..quant import transforms as tf
from ..quant.entropy import MAX_LEVEL, EntropyQuantizer, encode_role
from ..quant.grid import roundtrip_role
from ..quant.sensitivity import key_weights, value_weights
from ..scorers.tail_reads import tail_read_scores
from .feedback import feedback_values
from .refit import QUESTION_OFFSET, document_queries, refit_values
from ..versions import child_recipe

STAMP_BYTES = 64  # what the store adds per object beyond the encoded bundle (digits of the stamp)


def narrow_heads(recipe, n_layers: int, n_heads: int) -> dict[int, list[int]]:
    """Backfilled layer -> its KV heads that do NOT read the evicted tokens (``backfill`` "L.H")."""
    out = {}
    for i, wide in recipe.backfill_heads.items():
        if wide is None or i >= n_layers:
            continue
        if max(wide) >= n_heads:
            raise UsageError(f"option backfill names KV head {max(wide)} of layer {i}; the model has {n_heads} KV heads",
                             hint=f"heads are 0 to {n_heads - 1}", param="backfill")
        out[i] = [h for h in range(n_heads) if h not in wide]
    return out


def hide_rows(x: torch.Tensor, heads: list[int], evicted: torch.Tensor, bounds) -> None:
    """In place: ``x [H, T, D]``'s ``evicted`` rows of ``heads`` set to the mean of their chunk's
    other rows, so they quantize to codes of 0 and leave the chunk's mean as it was."""
    for ls, le in bounds:
        ev = evicted[ls:le]
        for h in heads:
            rows = x[h, ls:le]
            rows[ev] = rows[~ev].mean(0) if bool((~ev).any()) else 0.0


def key_basis_for(recipe, lm) -> str | None:
    """The sha256 of the key basis ``recipe.key_basis`` asks for (the one registered for ``lm``'s
    fingerprint: "auto" where there is one, "model" always), or None (keys in channels)."""
    if recipe.key_basis == "none":
        return None
    sha = basis_for_model(lm.fingerprint)
    if sha is None and recipe.key_basis == "model":
        raise UsageError("option key_basis=model: no key basis is registered for this model",
                         hint="calibrate one with scripts/calibrate_key_basis.py, or pass --option key_basis=none")
    return sha


def token_levels(n_tokens: int, header: int, protect: int, lift: torch.Tensor | None = None,
                 protect_level: int = PROTECT_LEVEL, lift_steps: tuple[float, int] = (LIFT_SHARE, LIFT_LEVEL)) -> torch.Tensor:
    """Per token: ``protect_level`` for the prompt header and the last ``protect`` tokens, the
    level of ``lift_steps`` for its share of the tokens ranked highest by ``lift`` (``[L, H, T]``
    ranks, averaged; ties to the earlier token), else 0."""
    levels = torch.zeros(n_tokens, dtype=torch.uint8)
    if lift is not None and n_tokens:
        share, level = lift_steps
        levels[lift_top(lift, share)] = level
    if protect:
        levels[-protect:] = protect_level
    levels[:header] = protect_level
    return levels


def lift_top(lift: torch.Tensor, share: float) -> torch.Tensor:
    """The ``share`` of the tokens ranked highest by ``lift`` (``[L, H, T]`` ranks, averaged;
    ties to the earlier token): the tokens ``--lift`` lifts."""
    return torch.argsort(-lift.float().mean((0, 1)), stable=True)[: int(share * lift.shape[-1])]


def shared_keep(importance: torch.Tensor, keep: float, header: int, protect: int,
                second: torch.Tensor | None = None, share: float = 0.0) -> torch.Tensor:
    """Ascending document indices of the ``round(keep * T)`` tokens with the highest importance
    (``[L, H, T]``, averaged over layers and heads; ties to the earlier token), the first
    ``header`` and the last ``protect`` tokens always kept. With ``second`` (``[T]``, e.g.
    ``tail_reads.tail_read_scores``), the last ``share`` of the tokens beyond the forced ones
    are the best of ``second`` among those not yet kept."""
    n = importance.shape[-1]
    score = importance.float().mean((0, 1))
    forced = torch.zeros(n, dtype=torch.bool)
    forced[:header] = True
    if protect:
        forced[-protect:] = True
    want = max(int(round(keep * n)), int(forced.sum()))
    order = sorted(range(n), key=lambda t: (not bool(forced[t]), -float(score[t]), t))
    if second is None or share <= 0:
        return torch.tensor(sorted(order[:want]), dtype=torch.int64)
    n_forced = int(forced.sum())
    first = order[:n_forced + round((1 - share) * (want - n_forced))]
    taken = set(first)
    rest = [t for t in sorted(range(n), key=lambda t: (-float(second[t]), t)) if t not in taken]
    return torch.tensor(sorted(first + rest[:want - len(first)]), dtype=torch.int64)


def refit_queries(lm, token_ids: list[int], bundles: list[KVBundle], n_layers: int):
    """(queries per layer, attention scale per layer) the value refit fits to: the document's
    own, placed after it (``kdnctl.compress.refit.document_queries``)."""
    last = max(int(b.layer_positions(0).max()) for b in bundles)
    return document_queries(lm, token_ids, n_layers, last + 1 + QUESTION_OFFSET)


def refitted(rho: float, queries: list[torch.Tensor], scales: list[float], keys: list[torch.Tensor],
             values: list[torch.Tensor], rows: torch.Tensor, hold: torch.Tensor | None = None,
             kept_keys: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The kept ``rows``' values per layer, refitted to the full attention (``kdnctl.compress.refit``);
    the kept tokens ``hold`` marks keep theirs; ``kept_keys`` per layer: the keys they are read
    with (default: ``keys``' rows)."""
    kept_keys = kept_keys or [None] * len(keys)
    return [refit_values(q, k, v, rows, s, rho, hold, kk).to(v.dtype)
            for q, k, v, s, kk in zip(queries, keys, values, scales, kept_keys)]


def decoded_keys(x: torch.Tensor, step: torch.Tensor, levels: torch.Tensor, bounds, basis: torch.Tensor | None,
                 positions: torch.Tensor, theta: float | None) -> torch.Tensor:
    """RoPE'd keys ``[H, T, D]`` as the loader decodes ec's transformed keys ``x`` coded at
    ``step`` chunk by chunk (``bounds``: each chunk's ``[start, end)`` in ``x``)."""
    k = torch.cat([roundtrip_role(x[:, a:b], step, levels[a:b], basis) for a, b in bounds], 1)
    return tf.rope(k, positions, theta) if theta else k


@contextlib.contextmanager
def one_torch_thread():
    """torch on one thread inside the block (small per-layer ops; on a machine shared with
    other jobs a fork-join waits for a descheduled thread)"""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _chunk_positions(chunk_positions: torch.Tensor, local: torch.Tensor, n_heads: int) -> torch.Tensor:
    """One layer's positions tensor for a chunk's kept tokens (int16 while they fit)."""
    p = chunk_positions[local]
    return p.to(kept_positions_dtype(p)).unsqueeze(0).expand(n_heads, -1).contiguous()


def sized_ec(src, label: str, step: dict, recipe, bundles: list[KVBundle], keys: list[torch.Tensor],
             values: list[torch.Tensor], token_ids: list[int], local_bounds, fp16: int, lm, lift=None,
             importance: torch.Tensor | None = None):
    """(tensors per chunk, meta per chunk, kept fraction, mix) for a version within
    ``recipe.budget`` x ``fp16`` bytes, everything included."""
    if lm is None:
        raise UsageError("--quant ec weighs channels with the model's queries and output projection",
                         hint="pass --model (or drop --quant ec)")
    n_layers, (n_heads, n_all, d) = len(keys), keys[0].shape
    cap = recipe.budget * fp16
    rope = bundles[0].meta["model"].get("rope") or {}
    theta = plain_rope_theta(rope)  # None: keys are coded as stored, after RoPE
    basis_sha = key_basis_for(recipe, lm)
    q = EntropyQuantizer(key_rope_theta=theta, key_basis=basis_sha)
    basis = load_basis(basis_sha) if basis_sha else None
    if basis is not None and tuple(basis.shape) != (n_layers, n_heads, d, d):
        raise UsageError(f"the key basis registered for this model is {list(basis.shape)}, its keys are "
                         f"[{n_layers}, {n_heads}, {d}, {d}]", hint="re-calibrate it: scripts/calibrate_key_basis.py")
    header = int(bundles[0].meta.get("header_tokens", 0))
    rows = hold = fit_queries = None
    all_keys, all_values = keys, values
    if recipe.keep < 1:
        if importance is None:
            raise UsageError("--quant ec with --keep needs a scorer to rank tokens", param="keep")
        second = tail_read_scores(lm, token_ids) if recipe.tail_reads else None
        rows = shared_keep(importance, recipe.keep, header, recipe.protect, second, recipe.tail_reads or 0.0)
        keys = [k[:, rows] for k in keys]
        lift = lift[..., rows] if lift is not None else None
        if recipe.refit_hold:  # the recipe has a lift (checked there)
            hold = torch.zeros(rows.numel(), dtype=torch.bool)
            hold[lift_top(lift, recipe.lift_steps[0])] = True
        fit_queries = refit_queries(lm, token_ids, bundles, n_layers) if recipe.refit else None
        # --refit-decoded refits below, once the keys' steps are known
        values = refitted(recipe.refit, *fit_queries, all_keys, all_values, rows, hold) \
            if recipe.refit and not recipe.refit_decoded else [v[:, rows] for v in values]
    n_tokens = keys[0].shape[1]
    all_positions = torch.cat([b.layer_positions(0)[0] for b in bundles])
    positions = all_positions
    if rows is not None:
        positions = positions[rows]
        # chunk c's kept tokens in the kept sequence: [kept_bounds[c][0], kept_bounds[c][1])
        kept_bounds = [(int((rows < ls).sum()), int((rows < le).sum())) for ls, le in local_bounds]
    else:
        kept_bounds = local_bounds
    levels = token_levels(n_tokens, header, recipe.protect, lift, recipe.tail_level, recipe.lift_steps)
    # --lift-role keys: the values keep the unlifted levels, the keys the lifted ones (1.10)
    split = lift is not None and recipe.lift_role == "keys"
    levels_by_role = (levels, token_levels(n_tokens, header, recipe.protect, None, recipe.tail_level) if split else levels)
    backfill = [i for i in recipe.backfill_layers if i < n_layers] if rows is not None else []
    shifts = recipe.backfill_shifts if backfill else (0, 0)  # (keys, values)
    full_levels = []  # per role: these layers keep every token, the evicted ones at level 0, the kept ones shifted up
    for shift, lv in zip(shifts, levels_by_role):
        full_levels.append(torch.zeros(n_all, dtype=torch.uint8))
        if backfill:
            full_levels[-1][rows] = lv + shift
    finest = int(levels.max()) if levels.numel() else 0
    assert finest + max(shifts) <= MAX_LEVEL
    kw = key_weights(lm, token_ids, n_layers, n_heads, d, rope=theta is not None)
    vw = value_weights(lm, n_layers, n_heads, d)
    xs = [q.forward(all_keys[i], all_values[i], all_positions.expand(n_heads, -1)) if i in backfill
          else q.forward(k, v, positions.expand(n_heads, -1)) for i, (k, v) in enumerate(zip(keys, values))]
    narrow = {i: h for i, h in narrow_heads(recipe, n_layers, n_heads).items() if i in backfill}
    evicted = torch.ones(n_all, dtype=torch.bool)
    if rows is not None:
        evicted[rows] = False
    narrow_mask = {i: torch.isin(torch.arange(n_heads), torch.tensor(h)) for i, h in narrow.items()}
    for i, heads in narrow.items():
        xs[i] = tuple(x.clone() for x in xs[i])  # the transform may hand back the caller's tensor
        for x in xs[i]:
            hide_rows(x, heads, evicted, local_bounds)
    # a backfilled layer's steps are those of its kept tokens: 2**shift x the level-0 step. A key
    # error weighted key_weight x a value error's: a uniform step's error grows as its square, so
    # at equal slope the keys' steps are 1/sqrt(key_weight) x theirs (choosing among similar
    # records is a key matter: research/probes/precision_probe.py)
    roles = ((kw, recipe.key_weight ** -0.5), (vw, 1.0))
    base = [tuple(relative_steps(x[:, rows] if i in backfill else x, w[i]) * m * (2.0 ** s if i in backfill else 1)
                  for x, (w, m), s in zip(xs[i], roles, shifts)) for i in range(n_layers)]
    # rotated rows reach sqrt(D) x a channel's largest code: the keys' floors make room for that
    widen = (d ** 0.5 if basis is not None else 1.0, 1.0)
    floors = [tuple(step_floor(x, finest + (s if i in backfill else 0)) * wd for x, s, wd in zip(xs[i], shifts, widen))
              for i in range(n_layers)]
    mult = None
    if recipe.layers == "fisher" and n_tokens > header:
        probe = lf.probe_ids(lm, token_ids, header)  # the document's own text, over the kept tokens' cache
        fisher = lf.channel_fisher(lm, keys, values, probe, int(positions.max()) + 1, 0.25 ** levels.float(), recipe.seed)
        mult = lf.layer_multipliers(lf.layer_damage(fisher, base))
        base = [(k * mult[i, 0], v * mult[i, 1]) for i, (k, v) in enumerate(base)]

    def steps_at(alpha: float, i: int):
        return tuple(clamp_steps(alpha * b, f) for b, f in zip(base[i], floors[i]))

    def encoded(alpha: float, feedback: bool = False):
        with one_torch_thread():  # hundreds of small tensors: fork-join costs more than it gives
            return _encoded(alpha, feedback)

    def _encoded(alpha: float, feedback: bool = False):
        # --refit-feedback: the values rounded with feedback at these steps (the sizes are fitted
        # without it: the same grid, codes a little apart)
        fed = [feedback_values(fit_queries[0][i], kept_keys[i] if kept_keys else keys[i], xs[i][1],
                               fit_queries[1][i], recipe.refit, steps_at(alpha, i)[1], levels_by_role[1],
                               kept_bounds, hold) for i in range(n_layers)] if feedback else None
        out = []
        for (ks, ke), (ls, le) in zip(kept_bounds, local_bounds):
            chunk = {}
            for i, (k, v) in enumerate(xs):
                for role, x, s, fl, rl in zip(("keys", "values"), (k, v), steps_at(alpha, i), full_levels, levels_by_role):
                    a, b, lv = (ls, le, fl[ls:le]) if i in backfill else (ks, ke, rl[ks:ke])
                    axes = basis[i] if basis is not None and role == "keys" else None
                    rows_here = held_rows(~evicted[ls:le], narrow_mask[i]) if i in narrow else None
                    mean = None
                    if fed is not None and role == "values":  # the grid is centred where plain rounding's is
                        x, mean = fed[i], x[:, a:b].mean(1)
                    chunk[tensor_name(i, f"{role}.codes")], chunk[tensor_name(i, f"{role}.params")] = \
                        encode_role(x[:, a:b], s, lv, q.coding, basis=axes, stored=rows_here, mean=mean)
            out.append(chunk)
        return out

    @functools.lru_cache(maxsize=None)  # sizes only: a long document's blobs are tens of MB per scale
    def payload(alpha: float) -> int:
        return sum(t.numel() for chunk in encoded(alpha) for t in chunk.values())

    overhead = len(bundles) * (6144 + 200 * n_layers) + 17 * n_tokens  # first guess: headers, ids, positions, levels
    kept_keys = first = None
    if rows is not None and recipe.refit_decoded:
        # fit the values to the kept keys as the loader will read them: coded at a first fit of the
        # scale (the refitted values move the final scale only a little)
        first = fit_near(payload, cap - overhead) if recipe.fit == "secant" else fit_scale(payload, cap - overhead)
        if first is not None:
            kept_keys = [decoded_keys(xs[i][0], steps_at(first, i)[0], levels_by_role[0], kept_bounds,
                                      None if basis is None else basis[i], positions, theta) for i in range(n_layers)]
            values = refitted(recipe.refit, *fit_queries, all_keys, all_values, rows, hold, kept_keys)
            xs = [(x[0], v.float()) for x, v in zip(xs, values)]  # ec's transform leaves values as they are
            base = [(b[0], relative_steps(x[1], vw[i]) * (1.0 if mult is None else mult[i, 1]))
                    for i, (b, x) in enumerate(zip(base, xs))]
            floors = [(f[0], step_floor(x[1], finest)) for f, x in zip(floors, xs)]
            payload.cache_clear()
    recipe_meta = child_recipe(src, step)
    qmeta = q.meta(n_heads, d)
    alpha = None
    for _attempt in range(4):
        if recipe.fit == "secant":
            alpha = fit_near(payload, cap - overhead, alpha or first or 0.5)  # a refit starts at the last scale
        else:  # a refit (the first guess of the headers was short) starts next to the last scale
            alpha = (alpha is not None and fit_scale(payload, cap - overhead, alpha, alpha * 1.25)) or \
                fit_scale(payload, cap - overhead)
        if alpha is None:
            smallest = (payload(64.0) + overhead) / fp16  # fit_scale's coarsest scale
            raise UsageError(f"a budget of {recipe.budget:g} is too small for --quant ec on this model even at its "
                             f"coarsest steps: the smallest it reaches here is {math.ceil(smallest * 1000) / 1000:g}",
                             hint="raise --budget, or --keep fewer tokens first")
        new_tensors, metas = [], []
        for b, (ls, le), (ks, ke), chunk in zip(bundles, local_bounds, kept_bounds,
                                                encoded(alpha, rows is not None and recipe.refit_feedback)):
            t = {"token_ids": b.tensors["token_ids"], "positions": b.tensors["positions"], **chunk}
            if backfill:  # layers of two lengths: each layer its own levels (a backfilled one: every token)
                for i in range(n_layers):
                    if i not in backfill:
                        if not split:  # else the chunk's two rows below
                            t[tensor_name(i, "levels")] = levels[ks:ke].clone()
                    elif shifts[0] == shifts[1] and not split:
                        t[tensor_name(i, "levels")] = full_levels[0][ls:le].clone()
                    else:  # keys and values apart: each role its own levels (format 1.5)
                        for role, fl in zip(("keys", "values"), full_levels):
                            t[tensor_name(i, f"{role}.levels")] = fl[ls:le].clone()
            if split:  # the kept tokens' levels: the values' and the keys' own (1.10)
                t["token_levels"], t["token_levels.keys"] = levels_by_role[1][ks:ke].clone(), levels[ks:ke].clone()
            elif not backfill:
                t["token_levels"] = levels[ks:ke].clone()
            if rows is not None:  # the chunk's kept tokens: the pruned layers' positions are stored once (1.9)
                t["kept"] = (~evicted[ls:le]).to(torch.uint8)
            if narrow:  # 1.8: which heads hold the kept tokens only
                t.update({tensor_name(i, "narrow"): m.to(torch.uint8) for i, m in narrow_mask.items()})
            local = None if rows is None else rows[ks:ke] - ls
            for i in range(n_layers):
                kept_here = local if i not in backfill else None
                if kept_here is not None:  # the same kept tokens in every such layer and head (own tensors: safetensors refuses shared memory)
                    t[tensor_name(i, "positions")] = _chunk_positions(b.tensors["positions"], kept_here, n_heads)
                bias = b.layer(i, "bias")
                if bias is not None:
                    t[tensor_name(i, "bias")] = bias if kept_here is None else bias[..., kept_here].contiguous()
            n_rows = sum(n_heads * (le - ls) - len(narrow.get(i, ())) * (le - ls - ke + ks) if i in backfill
                         else n_heads * (ke - ks) for i in range(n_layers))
            metas.append({"quant": {**qmeta, "alpha": round(alpha, 6),
                                    "mix": {"keys": {"ec": n_rows}, "values": {"ec": n_rows}}}})
            new_tensors.append(t)
        total = sum(len(encode_bundle(KVBundle(meta=derived_meta(b.meta, label=label, parent=src.label,
                                                                  recipe=recipe_meta, **m), tensors=t)))
                    for b, t, m in zip(bundles, new_tensors, metas)) + STAMP_BYTES * len(bundles)
        if total <= cap:
            n_rows = sum(n_heads * n_all - len(narrow.get(i, ())) * (n_all - n_tokens) if i in backfill
                         else n_heads * n_tokens for i in range(n_layers))
            return new_tensors, metas, n_rows / (n_heads * n_layers * n_all), {"keys": {"ec": n_rows}, "values": {"ec": n_rows}}
        overhead = total - payload(alpha) + 256
    raise UsageError(f"could not fit {recipe.budget:g} x the fp16 size with --quant ec", hint="raise --budget")
