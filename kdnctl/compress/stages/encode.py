"""Encode: one scale of the steps fitted so the encoded bundles fill the byte cap
(``kdnctl.allocate.rate``), then each chunk's tensors and meta, checked against the cap with
everything included (headers, token ids, positions, levels, the store's stamp)."""

from __future__ import annotations

import functools
import math

import torch

from ...allocate.rate import fit_near, fit_scale, relative_steps, step_floor
from ...errors import UsageError
from ...format.bundle import KVBundle, derived_meta, encode_bundle
from ...format.names import tensor_name
from ...format.kept import kept_positions_dtype
from ...presses.window_layers import first_row
from ...versions import child_recipe
from . import quantize as qz
from .base import Job, Stage
from .refit import refitted
from .payload_size import PayloadSize

FIT_GUESS = 0.5  # where the scale fit starts looking (the defaults land near 0.4, b0.25, and 1.0, b0.083)
STAMP_BYTES = 64  # what the store adds per object beyond the encoded bundle (digits of the stamp)


def _chunk_positions(chunk_positions: torch.Tensor, local: torch.Tensor, n_heads: int) -> torch.Tensor:
    """One layer's positions tensor for a chunk's kept tokens (int16 while they fit)."""
    p = chunk_positions[local]
    return p.to(kept_positions_dtype(p)).unsqueeze(0).expand(n_heads, -1).contiguous()


def chunk_tensors(job: Job, b: KVBundle, bounds: tuple[int, int], kept: tuple[int, int], codes: dict) -> dict:
    """One chunk's tensors: its codes, token ids, positions, levels, kept marks and bias."""
    (ls, le), (ks, ke) = bounds, kept
    rows, backfill, split, n_heads = job.rows, job.backfill, job.split, job.all_keys[0].shape[0]
    t = {"token_ids": b.tensors["token_ids"], "positions": b.tensors["positions"], **codes}
    if backfill:  # layers of two lengths: each layer its own levels (a backfilled one: every token)
        for i in range(job.n_layers):
            if i not in backfill:
                if not split:  # else the chunk's two rows below
                    t[tensor_name(i, "levels")] = job.levels[ks:ke].clone()
            elif job.shifts[0] == job.shifts[1] and not split:
                t[tensor_name(i, "levels")] = job.full_levels[0][ls:le].clone()
            else:  # keys and values apart: each role its own levels (format 1.5)
                for role, fl in zip(("keys", "values"), job.full_levels):
                    t[tensor_name(i, f"{role}.levels")] = fl[ls:le].clone()
    if split:  # the kept tokens' levels: the values' and the keys' own (1.10)
        t["token_levels"], t["token_levels.keys"] = job.levels_by_role[1][ks:ke].clone(), job.levels[ks:ke].clone()
    elif not backfill:
        t["token_levels"] = job.levels[ks:ke].clone()
    if rows is not None:  # the chunk's kept tokens: the pruned layers' positions are stored once (1.9)
        t["kept"] = (~job.evicted[ls:le]).to(torch.uint8)
    if job.narrow:  # 1.8: which heads hold the kept tokens only
        t.update({tensor_name(i, "narrow"): m.to(torch.uint8) for i, m in job.narrow_mask.items()})
    local = None if rows is None else rows[ks:ke] - ls
    for i in range(job.n_layers):
        kept_here = local if i not in backfill else None
        if i in job.wins:  # a window layer: the chunk's kept tokens in the window, their own levels
            a = first_row(job.wins, i, ks, ke)
            kept_here = (torch.arange(a, ke) if rows is None else rows[a:ke]) - ls
            for role, lv in zip(("keys.", "values.") if split else ("",), job.levels_by_role):
                t[tensor_name(i, f"{role}levels")] = lv[a:ke].clone()
        if kept_here is not None:  # the same kept tokens in every such layer and head (own tensors: safetensors refuses shared memory)
            t[tensor_name(i, "positions")] = _chunk_positions(b.tensors["positions"], kept_here, n_heads)
        bias = b.layer(i, "bias")
        if bias is not None:
            t[tensor_name(i, "bias")] = bias if kept_here is None else bias[..., kept_here].contiguous()
    return t


class Encode(Stage):
    """The fitted scale and the new version's tensors and meta per chunk (``job.result``)."""

    name = "encode"

    def run(self, job: Job) -> None:
        recipe, rows, backfill, narrow = job.recipe, job.rows, job.backfill, job.narrow
        n_heads, n_all, d = job.all_keys[0].shape
        n_tokens, cap = job.keys[0].shape[1], job.cap

        # The scale is fitted on the bytes of the blobs that give a role's frames one width
        # (``own_widths`` False); the version stores its frames at their own widths: the same
        # codes in fewer bytes, so it stores the K/V its budget's acceptance table measured,
        # under its cap.
        # The probes count the bytes (``PayloadSize``) where they can, else encode; the version
        # stored is encoded at the fitted scale either way (from the counted codes where the
        # probes counted).
        counted = [PayloadSize.for_job(job)]

        def encoded_size(codes) -> int:
            return sum(t.numel() for chunk in codes for t in chunk.values())

        @functools.lru_cache(maxsize=None)  # sizes only: a long document's blobs are tens of MB per scale
        def payload(alpha: float) -> int:
            n = None if counted[0] is None else counted[0](alpha)
            return encoded_size(qz.codes_at(job, alpha, own_widths=False)) if n is None else n

        recipe_meta = child_recipe(job.src, job.step)
        qmeta = job.quantizer.meta(n_heads, d)

        def bundles_at(codes, alpha: float):
            """(each chunk's tensors, metas, the stored bytes of all) with these code blobs."""
            new_tensors, metas = [], []
            for b, bounds, kept, chunk in zip(job.bundles, job.local_bounds, job.kept_bounds, codes):
                ls, le = bounds
                ks, ke = kept
                new_tensors.append(chunk_tensors(job, b, bounds, kept, chunk))
                n_rows = sum(n_heads * (le - ls) - len(narrow.get(i, ())) * (le - ls - ke + ks) if i in backfill
                             else n_heads * (ke - first_row(job.wins, i, ks, ke)) for i in range(job.n_layers))
                metas.append({"quant": {**qmeta, "alpha": round(alpha, 6),
                                        "mix": {"keys": {"ec": n_rows}, "values": {"ec": n_rows}}}, **job.win_meta})
            total = sum(len(encode_bundle(KVBundle(meta=derived_meta(b.meta, label=job.label, parent=job.src.label,
                                                                      recipe=recipe_meta, **m), tensors=t)))
                        for b, t, m in zip(job.bundles, new_tensors, metas)) + STAMP_BYTES * len(job.bundles)
            return new_tensors, metas, total

        def counted_total(sizes, alpha: float) -> int:
            """The stored bytes of every object with code blobs of these counted ``sizes``."""
            return bundles_at([{k: torch.empty(n, dtype=torch.uint8) for k, n in chunk.items()} for chunk in sizes],
                              alpha)[2]

        overhead = len(job.bundles) * (6144 + 200 * job.n_layers) + 17 * n_tokens  # first guess: headers, ids, positions, levels
        if counted[0] is not None:
            # what the objects hold beside the code blobs (headers, ids, positions, levels, the
            # params' sizes in the header) hardly moves with the scale: counted at the usual
            # scale, so that the fit meets the cap the first time rather than fitting again
            sizes = counted[0].blob_sizes(FIT_GUESS)
            if sizes is not None:
                overhead = counted_total(sizes, FIT_GUESS) - payload(FIT_GUESS) + 256
        kept_keys = first = None
        if rows is not None and recipe.refit_decoded:
            # fit the values to the kept keys as the loader will read them: coded at a first fit of the
            # scale (the refitted values move the final scale only a little)
            first = fit_near(payload, cap - overhead) if recipe.fit == "secant" else \
                fit_scale(payload, cap - overhead, guess=FIT_GUESS)
            if first is not None:
                kept_keys = [qz.decoded_keys(job.xs[i][0], qz.steps_at(job, first, i)[0], job.levels_by_role[0],
                                             job.kept_bounds, None if job.basis is None else job.basis[i], job.positions,
                                             job.theta) for i in range(job.n_layers)]
                job.values = refitted(recipe.refit, *job.fit_queries, job.all_keys, job.all_values, rows, job.hold,
                                      kept_keys, job.check_queries)
                job.xs = [(x[0], v.float()) for x, v in zip(job.xs, job.values)]  # ec's transform leaves values as they are
                job.base = [(b[0], relative_steps(x[1], job.value_weights[i]) * (1.0 if job.mult is None else job.mult[i, 1]))
                            for i, (b, x) in enumerate(zip(job.base, job.xs))]
                job.floors = [(f[0], step_floor(x[1], job.finest)) for f, x in zip(job.floors, job.xs)]
                counted[0] = counted[0] and PayloadSize.for_job(job)  # (the values' means moved)
                payload.cache_clear()
        alpha = None
        for _attempt in range(4):
            if recipe.fit == "secant":
                alpha = fit_near(payload, cap - overhead, alpha or first or 0.5)  # a refit starts at the last scale
            else:  # from next to the scale of the last fit (the first, before a refit), else the usual one
                alpha = fit_scale(payload, cap - overhead, guess=alpha or first or FIT_GUESS)
            if alpha is None:
                smallest = (payload(64.0) + overhead) / job.fp16  # fit_scale's coarsest scale
                raise UsageError(f"a budget of {recipe.budget:g} is too small for --quant ec on this model even at its "
                                 f"coarsest steps: the smallest it reaches here is {math.ceil(smallest * 1000) / 1000:g}",
                                 hint="raise --budget, or --keep fewer tokens first")
            feedback = rows is not None and recipe.refit_feedback
            # (the objects' bytes are not counted again before this encode: the overhead counted
            # at the usual scale puts the fit under the cap, and a miss takes the same step either way)
            codes = None
            if counted[0] is not None and not feedback:
                codes = counted[0].blobs(alpha)  # the codes the counts came from, deflated
                if codes is None and counted[0].blob_sizes(alpha) is not None:
                    # the counts missed the encoder's bytes: fit again from encodes (never expected;
                    # tests/test_deflate_size.py holds the counts to the encoder's bytes)
                    counted[0] = None
                    payload.cache_clear()
                    alpha = None
                    continue
            if codes is None:
                codes = qz.codes_at(job, alpha, feedback, kept_keys)
            new_tensors, metas, total = bundles_at(codes, alpha)
            if total <= cap:
                n_rows = sum(n_heads * n_all - len(narrow.get(i, ())) * (n_all - n_tokens) if i in backfill
                             else n_heads * (n_tokens - first_row(job.wins, i, 0, n_tokens)) for i in range(job.n_layers))
                mix = {"keys": {"ec": n_rows}, "values": {"ec": n_rows}}
                job.result = (new_tensors, metas, n_rows / (n_heads * job.n_layers * n_all), mix)
                return
            overhead = total - payload(alpha) + 256
        raise UsageError(f"could not fit {recipe.budget:g} x the fp16 size with --quant ec", hint="raise --budget")
