"""Size-budgeted chunks in the entropy-coded ``ec`` layout (``kdnctl compress --quant ec``).

Every token is kept. Each channel's step follows from how much attention depends on it
(``kdnctl.quant.sensitivity``: query energy for keys, ``o_proj`` column norms for values) and
one scale per document is fitted so the encoded bundles fill the byte cap
(``kdnctl.allocate.rate``). The prompt header and the last ``protect`` tokens are quantized
``2**PROTECT_LEVEL`` times finer: they precede every question.
"""

from __future__ import annotations

import functools

import torch

from .allocate.rate import clamp_steps, fit_scale, relative_steps, step_floor
from .bundle import KVBundle, derived_meta, encode_bundle, tensor_name
from .errors import UsageError
from .quant.entropy import MAX_LEVEL, EntropyQuantizer, encode_role
from .quant.sensitivity import key_weights, value_weights
from .versions import child_recipe

PROTECT_LEVEL = 2
LIFT_FRACTION, LIFT_LEVEL = 0.25, 1  # with --lift SCORER: the top quarter of tokens by it, 2x finer steps
STAMP_BYTES = 64  # what the store adds per object beyond the encoded bundle (digits of the stamp)


def token_levels(n_tokens: int, header: int, protect: int, lift: torch.Tensor | None = None) -> torch.Tensor:
    """Per token: PROTECT_LEVEL for the prompt header and the last ``protect`` tokens,
    LIFT_LEVEL for the top LIFT_FRACTION by ``lift`` (``[L, H, T]`` ranks, averaged), else 0."""
    levels = torch.zeros(n_tokens, dtype=torch.uint8)
    if lift is not None and n_tokens:
        top = lift.float().mean((0, 1)).argsort(descending=True)[: int(LIFT_FRACTION * n_tokens)]
        levels[top] = LIFT_LEVEL
    if protect:
        levels[-protect:] = PROTECT_LEVEL
    levels[:header] = PROTECT_LEVEL
    return levels


def sized_ec(src, label: str, step: dict, recipe, bundles: list[KVBundle], keys: list[torch.Tensor],
             values: list[torch.Tensor], token_ids: list[int], local_bounds, fp16: int, lm, lift=None):
    """(tensors per chunk, meta per chunk, kept fraction 1.0, mix) for a version within
    ``recipe.budget`` x ``fp16`` bytes, everything included."""
    if lm is None:
        raise UsageError("--quant ec weighs channels with the model's queries and output projection",
                         hint="pass --model (or drop --quant ec)")
    if recipe.keep < 1:
        raise UsageError("--quant ec keeps every token", hint="drop --keep, or use another --quant", param="keep")
    n_layers, (n_heads, n_tokens, d) = len(keys), keys[0].shape
    cap = recipe.budget * fp16
    rope = bundles[0].meta["model"].get("rope") or {}
    theta = rope.get("rope_theta") if rope.get("rope_type", "default") == "default" else None
    q = EntropyQuantizer(key_rope_theta=theta)
    positions = torch.cat([b.layer_positions(0)[0] for b in bundles])
    levels = token_levels(n_tokens, int(bundles[0].meta.get("header_tokens", 0)), recipe.protect, lift)
    finest = int(levels.max()) if levels.numel() else 0
    assert finest <= MAX_LEVEL
    kw = key_weights(lm, token_ids, n_layers, n_heads, d, rope=theta is not None)
    vw = value_weights(lm, n_layers, n_heads, d)
    xs = [q.forward(k, v, positions.expand(n_heads, -1)) for k, v in zip(keys, values)]  # [(k, v)] transformed
    base = [(relative_steps(k, kw[i]), relative_steps(v, vw[i])) for i, (k, v) in enumerate(xs)]
    floors = [(step_floor(k, finest), step_floor(v, finest)) for k, v in xs]

    def steps_at(alpha: float, i: int):
        return tuple(clamp_steps(alpha * b, f) for b, f in zip(base[i], floors[i]))

    def encoded(alpha: float):
        out = []
        for ls, le in local_bounds:
            lv = levels[ls:le]
            chunk = {}
            for i, (k, v) in enumerate(xs):
                for role, x, s in zip(("keys", "values"), (k, v), steps_at(alpha, i)):
                    chunk[tensor_name(i, f"{role}.codes")], chunk[tensor_name(i, f"{role}.params")] = \
                        encode_role(x[:, ls:le], s, lv, q.zstd_level)
            out.append(chunk)
        return out

    @functools.lru_cache(maxsize=None)  # sizes only: a long document's blobs are tens of MB per scale
    def payload(alpha: float) -> int:
        return sum(t.numel() for chunk in encoded(alpha) for t in chunk.values())

    recipe_meta = child_recipe(src, step)
    qmeta = q.meta(n_heads, d)
    overhead = len(bundles) * (6144 + 200 * n_layers) + 17 * n_tokens  # first guess: headers, ids, positions, levels
    alpha = None
    for _attempt in range(4):
        # a refit (the first guess of the headers was short) starts next to the last scale
        alpha = (alpha is not None and fit_scale(payload, cap - overhead, alpha, alpha * 1.25)) or \
            fit_scale(payload, cap - overhead)
        if alpha is None:
            raise UsageError(f"a budget of {recipe.budget:g} is too small for --quant ec even at its coarsest steps",
                             hint="raise --budget or use --quant auto (which evicts)")
        new_tensors, metas = [], []
        for b, (ls, le), chunk in zip(bundles, local_bounds, encoded(alpha)):
            t = {"token_ids": b.tensors["token_ids"], "positions": b.tensors["positions"],
                 "token_levels": levels[ls:le].clone(), **chunk}
            for i in range(n_layers):
                bias = b.layer(i, "bias")
                if bias is not None:
                    t[tensor_name(i, "bias")] = bias
            rows = n_heads * (le - ls) * n_layers
            metas.append({"quant": {**qmeta, "alpha": round(alpha, 6),
                                    "mix": {"keys": {"ec": rows}, "values": {"ec": rows}}}})
            new_tensors.append(t)
        total = sum(len(encode_bundle(KVBundle(meta=derived_meta(b.meta, label=label, parent=src.label,
                                                                  recipe=recipe_meta, **m), tensors=t)))
                    for b, t, m in zip(bundles, new_tensors, metas)) + STAMP_BYTES * len(bundles)
        if total <= cap:
            rows = n_heads * n_tokens * n_layers
            return new_tensors, metas, 1.0, {"keys": {"ec": rows}, "values": {"ec": rows}}
        overhead = total - payload(alpha) + 256
    raise UsageError(f"could not fit {recipe.budget:g} x the fp16 size with --quant ec", hint="raise --budget")
