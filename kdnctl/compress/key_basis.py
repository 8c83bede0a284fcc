"""The key basis a compress codes keys in, found or made before it starts: a basis directory's
(shipped with kdnctl, or ``$KDNCTL_KEY_BASES``), else the store's, else calibrated now on the
store's own documents and stored there (``kdnctl.quant.store_basis``)."""

from __future__ import annotations

import contextlib

from ..format import key_basis as kb
from ..quant.store_basis import calibrate_into_store


def ensure_key_basis(store, lm, wanted: bool) -> str | None:
    """Before a compress whose recipe uses a key basis (``wanted``: ``recipe.uses_key_basis``):
    the sha256 of the basis it will code keys in, its file made known to this process (a basis
    directory's, else the store's, else calibrated now and stored), or None. Compress inside
    ``with kb.model_basis(lm.fingerprint, sha)``."""
    if lm is None or not wanted:
        return None
    fp = lm.fingerprint
    sha = kb.shipped_basis_for_model(fp)
    if sha is not None:
        return sha
    from ..store.bases import basis_record

    rec = basis_record(store, fp)
    if rec is not None:
        return kb.provide(store.read_object(rec.object))
    return calibrate_into_store(store, lm)


def key_basis_scope(store, lm, wanted: bool):
    """A context for one compress in ``store``: the model's key basis as :func:`ensure_key_basis`
    finds or makes it is the one ``basis_for_model`` answers within it."""
    sha = ensure_key_basis(store, lm, wanted)
    return kb.model_basis(lm.fingerprint, sha) if sha is not None else contextlib.nullcontext()
