"""Key bases kept in a store: calibrated on a model's first compress, found again by every load.

A model whose fingerprint no basis directory maps (kdnctl/quant/basis.py) gets a basis the first
time ``ec`` compresses one of its documents: the same computation as the shipped ones
(:func:`kdnctl.quant.basis.calibrate` over :func:`~kdnctl.quant.basis.key_samples`), on the
store's own documents (up to ``CAL_DOCS`` texts, ``CAL_TOKENS`` tokens each, in document-id
order, so the same store gives the same file). The file names its model and goes into the
store as an object with a catalog record (kdnctl/store/bases.py); later compresses reuse it.

A bundle names its basis by sha256, so a load needs no record: :func:`provide_store_bases`
reads the object (local file or remote fetch, both verified) before decoding.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kdnctl.errors import BundleFormatError, NotFoundError, StoreCorruptError, UsageError

from kdnctl.format import key_basis as kb

from . import basis as kcal

CAL_DOCS = 16  # documents a calibration reads at most
CAL_TOKENS = 1500  # tokens of each (the shipped bases read 16 pages of up to 1500 tokens)


def wants_basis(recipe) -> bool:
    """Whether ``recipe`` codes keys with ``ec`` and may use a model's key basis."""
    return bool(getattr(recipe, "uses_key_basis", False))


def calibration_texts(store, fingerprint: str, max_docs: int = CAL_DOCS) -> list[str]:
    """The texts of the store's documents made with model ``fingerprint`` (current versions, by
    document id): what a basis is calibrated on."""
    docs = sorted((d for d in store.list_documents() if d.fingerprint == fingerprint), key=lambda d: d.doc_id)
    return [bytes(store.read_object(d.text_object)).decode("utf-8", "replace") for d in docs[:max_docs]]


def basis_file(lm, texts: list[str], max_tokens: int = CAL_TOKENS) -> tuple[bytes, int, int]:
    """(the basis file calibrated for ``lm`` on ``texts``, naming its model; documents; tokens)."""
    token_lists = [ids for ids in (list(lm.tokenizer(t)["input_ids"])[:max_tokens] for t in texts) if len(ids) >= 2]
    return file_from_tokens(lm, token_lists), len(token_lists), sum(map(len, token_lists))


def file_from_tokens(lm, token_lists: list[list[int]]) -> bytes:
    if not token_lists:
        raise UsageError("calibrating a key basis needs at least one document of this model in the store",
                         hint="ingest a document first, or pass --option key_basis=none")
    return kb.encode_basis(kcal.calibrate(kcal.key_samples(lm, token_lists)), lm.fingerprint)


def store_basis(store, fingerprint: str, data: bytes, source: str, *, quiet: bool = False) -> str:
    """Record a calibrated basis file in ``store`` for ``fingerprint``, make it known to this
    process and say so on stderr (one line); returns its sha256."""
    from kdnctl.store.bases import commit_basis

    with store.writer():
        sha = commit_basis(store, fingerprint, data, source)
    kb.provide(data)
    if not quiet:
        print(f"key basis {sha[:12]} {source} for model {fingerprint[:12]}; stored in "
              f"{getattr(store, 'root', 'the store')}", file=sys.stderr)
    return sha


def calibrate_into_store(store, lm, token_lists: list[list[int]] | None = None, *, source: str | None = None,
                         quiet: bool = False) -> str:
    """Calibrate ``lm``'s key basis (on ``token_lists``, default the store's own documents), store
    it and record it for the model; returns its sha256. Says so on stderr in one line."""
    if token_lists is None:
        data, n_docs, n_tokens = basis_file(lm, calibration_texts(store, lm.fingerprint))
        source = source or f"calibrated on {n_docs} document(s) of this store"
    else:
        data, n_tokens = file_from_tokens(lm, token_lists), sum(map(len, token_lists))
    return store_basis(store, lm.fingerprint, data, f"{source or 'calibrated'} ({n_tokens} tokens)", quiet=quiet)


def basis_for_workers(store, recipe, fingerprint: str | None, calibrate) -> bytes | None:
    """For a compress whose workers cannot read the catalog (kdnctl/distributed): the basis file
    they code keys in where no basis directory has one for ``fingerprint``: the store's, else one
    ``calibrate(texts) -> (file, documents, tokens)`` makes (on a worker) and the store records;
    None where a basis directory has it or the recipe does not use one."""
    if fingerprint is None or not wants_basis(recipe) or kb.shipped_basis_for_model(fingerprint) is not None:
        return None
    from kdnctl.store.bases import basis_record

    rec = basis_record(store, fingerprint)
    if rec is not None:
        return bytes(store.read_object(rec.object))
    texts = calibration_texts(store, fingerprint)
    if not texts:
        raise UsageError("calibrating a key basis needs at least one document of this model in the store",
                         hint="ingest a document first, or pass --option key_basis=none")
    data, n_docs, n_tokens = calibrate(texts)
    store_basis(store, fingerprint, data, f"calibrated on {n_docs} document(s) of this store ({n_tokens} tokens)")
    return data


def basis_shas(metas) -> list[str]:
    """The key bases (sha256) that bundles with metadata ``metas`` are coded in."""
    out = []
    for m in metas:
        q = m.get("quant") if isinstance(m, dict) else None
        sha = q.get("key_basis") if isinstance(q, dict) else None
        if isinstance(sha, str) and sha not in out:
            out.append(sha)
    return out


def provide_store_bases(store, shas) -> None:
    """Make the bases ``shas`` readable by this process's decoders: those no basis directory holds
    come from ``store`` (a local object or a remote fetch, verified against the sha256)."""
    for sha in shas:
        if kb.known(sha) or not kb.is_sha(sha):  # (a malformed id: the decoder refuses it)
            continue
        try:
            if not store.has_object(sha):
                continue  # the decoder names the missing basis
            data = store.read_object(sha)
        except (StoreCorruptError, NotFoundError) as e:
            raise BundleFormatError(f"key basis {sha[:12]} cannot be read from the store: {e.message}",
                                    hint="run `kdnctl verify`") from None
        kb.provide(data)


def recover_basis_records(store, paths: list[Path]) -> int:
    """Record every key basis file among ``paths`` (objects no bundle names) for the model it names;
    the newest file of a model wins. Returns how many records were written."""
    import hashlib

    newest: dict[str, tuple[float, bytes]] = {}
    for p in paths:
        try:
            data = p.read_bytes()
            if hashlib.sha256(data).hexdigest() != p.name:
                continue
            _, fp = kb.decode_basis(data, p.name)
        except (OSError, BundleFormatError):
            continue
        if fp is not None and (fp not in newest or p.stat().st_mtime > newest[fp][0]):
            newest[fp] = (p.stat().st_mtime, data)
    from kdnctl.store.bases import commit_basis

    with store.writer():
        for fp, (_, data) in sorted(newest.items()):
            commit_basis(store, fp, data, "recovered by rebuild-catalog")
    return len(newest)

