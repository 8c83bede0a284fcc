"""Coder: the entropy-coded ``ec`` layout's quantizer and the key basis its keys are coded in.

Size-budgeted chunks in the entropy-coded ``ec`` layout (``kdnctl compress --quant ec``).

Every token is kept, unless ``--keep K`` evicts first: then one set of tokens, the same in every
layer and KV head (the top ``K`` of the scorer's importance averaged over layers and heads, the
prompt header and the last ``protect`` tokens always among them; with the ``sentences`` scorer,
whole sentences), is kept and quantized. Each channel's step follows from how much attention depends on it
(``kdnctl.quant.sensitivity``: query energy for keys, the output projection's column norms for values) and
one scale per document is fitted so the encoded bundles fill the byte cap
(``kdnctl.allocate.rate``); with ``layers="fisher"`` (the default, but with ``backfill``)
each layer's and role's steps are first scaled by how much its error costs the model
(``kdnctl.allocate.layer_fisher``, the model's profile where the store has one); ``key_weight``
W makes every key step ``1/sqrt(W)`` of its value-relative size. The prompt header and the last ``protect`` tokens are
quantized ``2**PROTECT_LEVEL`` times finer (``--protect-level``): they precede every question. With ``backfill``
("A-B", opt-in) layers A..B also keep the evicted tokens, ``2**backfill_shift`` times coarser
(the keys ``2**backfill_key_shift`` where it is set: per-role levels). Where ``backfill`` names
KV heads of a layer ("18.2") only those read the evicted tokens: the layer holds every token
(``layers.i.levels``), its other heads code their kept rows only (format 1.8: ``layers.i.narrow``
marks them, the chunk's ``kept`` the tokens), their evicted rows decode to the chunk's mean, and
readers mask their query heads off those rows (``KVBundle.layer_bias``).
"""

from __future__ import annotations

from ...errors import UsageError
from ...format.key_basis import basis_for_model, load_basis
from ...models import plain_rope_theta
from ...quant.entropy import EntropyQuantizer
from .base import Job, Stage


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


class ECCoder(Stage):
    """``job.quantizer``, ``job.basis`` and ``job.theta`` (the keys' RoPE base) for the ec stages."""

    name = "coder"

    def run(self, job: Job) -> None:
        if job.lm is None:
            raise UsageError("--quant ec weighs channels with the model's queries and output projection",
                             hint="pass --model (or drop --quant ec)")
        n_layers, (n_heads, _, d) = len(job.keys), job.keys[0].shape
        rope = job.bundles[0].meta["model"].get("rope") or {}
        job.theta = plain_rope_theta(rope)  # None: keys are coded as stored, after RoPE
        basis_sha = key_basis_for(job.recipe, job.lm)
        job.quantizer = EntropyQuantizer(key_rope_theta=job.theta, key_basis=basis_sha)
        job.basis = load_basis(basis_sha) if basis_sha else None
        if job.basis is not None and tuple(job.basis.shape) != (n_layers, n_heads, d, d):
            raise UsageError(f"the key basis registered for this model is {list(job.basis.shape)}, its keys are "
                             f"[{n_layers}, {n_heads}, {d}, {d}]", hint="re-calibrate it: scripts/calibrate_key_basis.py")
