"""The one way to write a version: chunk bundles -> objects -> one catalog commit.

Every step that makes a version (ingest in both modes, compress, the steering edits, and later
writers) goes through these functions, in three separable stages so that the objects can be
written by one process (a worker) and the catalog committed by another (the driver):

1. ``existing_version``: the "same recipe = unchanged" check (a label already made by the same
   last recipe step is returned; a label made by another step is an error);
2. ``write_chunks``: encode each chunk bundle and put it into the store's content-addressed
   objects, returning its ``ChunkRef`` (idempotent: the same bundle is the same object);
3. ``version_record`` + ``commit``: build the catalog record and commit it (with the document
   record for a new document) in one transaction.

``derive_version`` runs 2 and 3 for a version derived from a source version (compress, edit):
the caller supplies only the new tensors of each chunk and any extra metadata.
A version's recipe is ``{"steps": [...]}``: the source's steps plus the step that made it; an
ingest version stores its single step as the recipe itself (the format bundles already carry).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Protocol

from .format.bundle import KVBundle, derived_meta, encode_bundle
from .errors import UsageError
from .store import ChunkRef, DocumentRecord, VersionRecord

WRITE_THREADS = 4


class ObjectWriter(Protocol):
    """What ``write_chunks`` needs of a store: content-addressed, idempotent object writes."""

    def put_object(self, data: bytes) -> str: ...


def recipe_steps(recipe: dict) -> list[dict]:
    """The steps that made a version, oldest first (an ingest recipe is its own single step)."""
    return list(recipe["steps"]) if "steps" in recipe else [recipe]


def child_recipe(parent: VersionRecord, step: dict) -> dict:
    """Recipe of a version made from ``parent`` by ``step``."""
    return {"steps": recipe_steps(parent.recipe) + [step]}


def existing_version(store, doc_id: str, label: str, step: dict, *, doc_version: str | None = None) -> VersionRecord | None:
    """The version ``label`` of ``doc_id`` when its last recipe step is ``step`` (re-running the
    same step is a no-op); None when there is no such label. Raises ``UsageError`` when the
    label was made by another step. Only versions of ``doc_version`` count when given."""
    for v in store.list_versions(doc_id):
        if v.label != label or (doc_version is not None and v.doc_version != doc_version):
            continue
        if recipe_steps(v.recipe)[-1] == step:
            return v
        raise UsageError(f"version {label!r} of {doc_id} was made by another recipe", hint="choose another label",
                         param="label")
    return None


def write_chunk(store: ObjectWriter, bundle: KVBundle, index: int | None = None) -> ChunkRef:
    """Encode ``bundle`` into the store's objects; its ChunkRef (``index`` defaults to the
    bundle's ``chunk_index``)."""
    data = encode_bundle(bundle)
    sha = store.put_object(data)
    m = bundle.meta
    return ChunkRef(m["chunk_index"] if index is None else index, sha, m["token_start"], m["token_end"],
                    m["chain_hash"], len(data))


def write_chunks(store: ObjectWriter, bundles: Iterable[KVBundle], indices: Iterable[int] | None = None) -> list[ChunkRef]:
    """``write_chunk`` for every bundle, in order. Safe to run in a worker process: it touches
    only the object directory, never the catalog."""
    bundles = list(bundles)
    idx = list(indices) if indices is not None else [None] * len(bundles)
    if len(bundles) <= 1:
        return [write_chunk(store, b, i) for b, i in zip(bundles, idx)]
    # Hashing, writing and fsync release the GIL: a few threads overlap one chunk's fsync wait
    # with the next one's hashing (objects are independent files; the catalog is not touched).
    with ThreadPoolExecutor(max_workers=min(WRITE_THREADS, len(bundles))) as pool:
        return list(pool.map(lambda pair: write_chunk(store, *pair), zip(bundles, idx)))


def version_record(source: VersionRecord, label: str, recipe: dict, chunks: list[ChunkRef], *,
                   created: float | None = None) -> VersionRecord:
    """The catalog record of a version derived from ``source`` (same document version, model,
    token count and mode; ``parent`` = the source's label)."""
    return VersionRecord(source.doc_id, source.doc_version, label, source.label, recipe, source.fingerprint, chunks,
                         time.time() if created is None else created, source.n_tokens, source.mode)


def commit(store, record: VersionRecord, document: DocumentRecord | None = None) -> VersionRecord:
    """Commit ``record`` (with ``document``, for a new document version) in one catalog
    transaction. Every object it references must already be in the store."""
    if document is not None:
        store.commit_document(document, record)
    else:
        store.commit_version(record)
    return record


def derive_version(store, source: VersionRecord, label: str, step: dict, source_bundles: list[KVBundle],
                   new_tensors: list[dict[str, Any]], *, meta: list[dict[str, Any]] | dict[str, Any] | None = None,
                   indices: Iterable[int] | None = None) -> VersionRecord:
    """Write and commit version ``label`` of ``source``'s document, made by ``step``: chunk c
    holds ``new_tensors[c]`` and ``source_bundles[c]``'s meta with fresh stamps, the new
    label, parent and recipe, plus ``meta`` (one dict for every chunk, or one per chunk)."""
    return commit(store, write_derived(store, source, label, step, source_bundles, new_tensors, meta=meta,
                                       indices=indices))


def write_derived(objects: ObjectWriter, source: VersionRecord, label: str, step: dict, source_bundles: list[KVBundle],
                  new_tensors: list[dict[str, Any]], *, meta: list[dict[str, Any]] | dict[str, Any] | None = None,
                  indices: Iterable[int] | None = None) -> VersionRecord:
    """``derive_version`` without the commit: write the chunks into ``objects`` and return the
    record for another process (a distributed driver) to ``commit``."""
    recipe = child_recipe(source, step)
    extra = meta if isinstance(meta, list) else [meta or {}] * len(source_bundles)
    bundles = [KVBundle(meta=derived_meta(b.meta, label=label, parent=source.label, recipe=recipe, **x), tensors=t)
               for b, t, x in zip(source_bundles, new_tensors, extra)]
    chunks = write_chunks(objects, bundles, indices)
    return version_record(source, label, recipe, chunks)
