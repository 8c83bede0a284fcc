"""The Fisher profile a compress spreads its bytes over layers with, found or made before it
starts: the store's, else measured now on the store's own documents and recorded there
(kdnctl/allocate/fisher_profile.py, kdnctl/store/profiles.py).

The documents are the current ``full`` versions made with the model, in document-id order (up
to ``CAL_DOCS``, the first ``CAL_TOKENS`` tokens of each), so the same store gives the same
profile, also after ``rebuild-catalog`` drops the record.
"""

from __future__ import annotations

import contextlib

import torch

from ..allocate import fisher_profile as fpro
from ..errors import NotFoundError
from ..format.bundle import decode_bundle
from ..quant import layer_kv


def wants_profile(recipe) -> bool:
    """Whether ``recipe`` scales ec's steps per layer and role by the Fisher estimate."""
    return bool(recipe.sized and recipe.quant == "ec" and recipe.layers == "fisher")


def calibration_versions(store, fingerprint: str) -> list:
    """The ``full`` versions a profile for ``fingerprint`` is measured on: of the store's current
    documents made with that model, by document id, up to ``CAL_DOCS`` (:func:`samples` passes
    over a version whose chunks are pruned or quantized)."""
    out = []
    for d in sorted((d for d in store.list_documents() if d.fingerprint == fingerprint), key=lambda d: d.doc_id):
        try:
            v = store.get_version(d.doc_id, "full")
        except NotFoundError:
            continue
        out.append(v)
        if len(out) == fpro.CAL_DOCS:
            break
    return out


def samples(objects, versions, max_tokens: int = fpro.CAL_TOKENS):
    """Each version's first ``max_tokens`` tokens as :func:`fisher_profile.calibrate` takes them
    (versions whose chunks are pruned or quantized are passed over)."""
    for v in versions:
        bundles, n = [], 0
        for c in v.chunks:
            if n >= max_tokens:
                break
            b = decode_bundle(objects.read_object(c.object))
            if "quant" in b.meta or "positions" not in b.tensors:
                bundles = []
                break
            bundles.append(b)
            n += b.token_ids.numel()
        if not bundles:
            continue
        n_layers = bundles[0].n_layers
        dense = [[layer_kv(b, i) for i in range(n_layers)] for b in bundles]
        keys = [torch.cat([d[i][0] for d in dense], 1)[:, :max_tokens].float() for i in range(n_layers)]
        values = [torch.cat([d[i][1] for d in dense], 1)[:, :max_tokens].float() for i in range(n_layers)]
        ids = [int(t) for b in bundles for t in b.token_ids.tolist()][:max_tokens]
        start = int(bundles[0].meta["token_start"]) + len(ids)
        yield ids, int(bundles[0].meta.get("header_tokens", 0)), keys, values, start


def measure(objects, lm, versions) -> tuple[bytes | None, str]:
    """(the profile file measured on ``versions``' caches, or None; how it was made, one line)."""
    profile, n = fpro.calibrate(lm, samples(objects, versions))
    if profile is None:
        return None, ""
    return fpro.encode(profile), f"measured on {n} document(s) of this store"


def ensure_profile(store, lm, wanted: bool) -> torch.Tensor | None:
    """Before a compress whose recipe wants one: the model's Fisher profile (the store's record,
    else measured now and recorded, saying so on stderr in one line), or None (the recipe wants
    none, or the store has no document to measure it on: each document's own estimate)."""
    if lm is None or not wanted:
        return None
    from ..store.profiles import commit_profile, profile_record

    fp = lm.fingerprint
    rec = profile_record(store, fp)
    if rec is not None:
        return rec.profile
    data, source = measure(store, lm, calibration_versions(store, fp))
    if data is None:
        return None
    commit_profile(store, fp, data, source)
    return fpro.decode(data, "the new Fisher profile")


def profile_scope(store, lm, wanted: bool):
    """A context for one compress in ``store``: the model's profile as :func:`ensure_profile`
    finds or makes it is the one the quantize stage reads (``fisher_profile.profile_for``)."""
    profile = ensure_profile(store, lm, wanted)
    return fpro.model_profile(lm.fingerprint, profile) if profile is not None else contextlib.nullcontext()
