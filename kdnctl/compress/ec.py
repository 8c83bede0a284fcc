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

from ..errors import UsageError
from ..format.bundle import KVBundle
from ..models import plain_rope_theta
from ..format.key_basis import basis_for_model, load_basis
from ..quant.entropy import EntropyQuantizer
from .stages import Job, run_pipeline


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


def sized_ec(src, label: str, step: dict, recipe, bundles: list[KVBundle], keys, values, token_ids: list[int],
             local_bounds, fp16: int, lm, lift=None, importance=None, stats=None):
    """(tensors per chunk, meta per chunk, kept fraction, mix) for a version within
    ``recipe.budget`` x ``fp16`` bytes, everything included: the quantizer and key basis set up,
    then every stage of the pipeline (``kdnctl.compress.stages``)."""
    if lm is None:
        raise UsageError("--quant ec weighs channels with the model's queries and output projection",
                         hint="pass --model (or drop --quant ec)")
    n_layers, (n_heads, _, d) = len(keys), keys[0].shape
    rope = bundles[0].meta["model"].get("rope") or {}
    theta = plain_rope_theta(rope)  # None: keys are coded as stored, after RoPE
    basis_sha = key_basis_for(recipe, lm)
    basis = load_basis(basis_sha) if basis_sha else None
    if basis is not None and tuple(basis.shape) != (n_layers, n_heads, d, d):
        raise UsageError(f"the key basis registered for this model is {list(basis.shape)}, its keys are "
                         f"[{n_layers}, {n_heads}, {d}, {d}]", hint="re-calibrate it: scripts/calibrate_key_basis.py")
    job = Job(src=src, label=label, step=step, recipe=recipe, bundles=bundles, keys=keys, values=values,
              token_ids=token_ids, local_bounds=local_bounds, fp16=fp16, lm=lm, lift=lift, importance=importance,
              stats=dict(stats or {}), theta=theta, all_keys=keys, all_values=values, basis=basis,
              quantizer=EntropyQuantizer(key_rope_theta=theta, key_basis=basis_sha))
    return run_pipeline(job).result
