"""Tiny REAL bundles and store entries for store/server tests that need no model.

A chunk is given as bytes; its bundle encodes those bytes as token ids, so distinct bytes give
distinct objects, and the bundle metadata names the document/version/chunk it belongs to
(verify and the loader cross-check it against the catalog)."""

from __future__ import annotations

import hashlib
import time

import torch

from kdnctl.format.bundle import KVBundle, encode_bundle, make_meta
from kdnctl.store import ChunkRef, DocumentRecord, Store, VersionRecord

FP = "f" * 64


def chain(i: int, salt: str = "") -> str:
    return hashlib.sha256(f"chain{i}{salt}".encode()).hexdigest()


def bundle_bytes(payload: bytes, *, doc_id: str, doc_version: str, index: int, start: int, end: int,
                 chain_hash: str, label: str = "full", fp: str = FP, mode: str = "prefix") -> bytes:
    n = end - start
    ids = list(payload[:n]) + [0] * max(0, n - len(payload))
    seed = int.from_bytes(hashlib.sha256(payload).digest()[:4], "little")
    g = torch.Generator().manual_seed(seed)
    tensors = {"token_ids": torch.tensor(ids, dtype=torch.int64),
               "positions": torch.arange(start, end, dtype=torch.int64),
               "layers.0.keys": torch.randn(1, n, 2, generator=g).half(),
               "layers.0.values": torch.randn(1, n, 2, generator=g).half()}
    meta = make_meta(model_fingerprint=fp, model={"n_layers": 1, "n_kv_heads": 1, "head_dim": 2},
                     doc_id=doc_id, doc_version=doc_version, chunk_index=index, n_chunks=1,
                     token_start=start, token_end=end, chain_hash=chain_hash, label=label, parent=None,
                     recipe={}, dtype="float16", mode=mode, payload=payload.hex())
    meta["created"] = 0.0  # equal payloads -> equal bytes
    return encode_bundle(KVBundle(meta=meta, tensors=tensors))


def put_chunks(store: Store, doc_id: str, dv: str, label: str, chunks, salt: str = "", mode: str = "prefix",
               fp: str = FP) -> list[ChunkRef]:
    refs = []
    for i, c in enumerate(chunks):
        if mode == "independent":  # document-neutral, as independent ingest writes them
            b_doc, b_dv, b_index = f"chunk-{chain(i, salt)[:16]}", chain(i, salt)[:16], 0
        else:
            b_doc, b_dv, b_index = doc_id, dv, i
        data = bundle_bytes(c, doc_id=b_doc, doc_version=b_dv, index=b_index, start=4 * i, end=4 * i + 4,
                            chain_hash=chain(i, salt), label=label, fp=fp, mode=mode)
        refs.append(ChunkRef(i, store.put_object(data), 4 * i, 4 * i + 4, chain(i, salt), len(data)))
    return refs


def add_doc(store: Store, doc_id="doc-a", text=b"hello world", chunks=(b"c0", b"c1"), *,
            label="full", salt="", created=None, mode="prefix"):
    """Put the text and chunk objects, then commit a document with one version."""
    dv = hashlib.sha256(text).hexdigest()[:16]
    created = time.time() if created is None else created
    with store.writer():
        text_sha = store.put_object(text)
        refs = put_chunks(store, doc_id, dv, label, chunks, salt, mode)
        doc = DocumentRecord(doc_id, dv, hashlib.sha256(text).hexdigest(), f"/src/{doc_id}.txt", 4 * len(chunks), FP,
                             text_sha, created)
        ver = VersionRecord(doc_id, dv, label, None, {"chunk_tokens": 4}, FP, refs, created, 4 * len(chunks), mode)
        store.commit_document(doc, ver)
    return doc, ver


def add_label(store: Store, doc: DocumentRecord, label: str, chunks, salt="", mode="prefix"):
    with store.writer():
        refs = put_chunks(store, doc.doc_id, doc.doc_version, label, chunks, salt, mode)
        ver = VersionRecord(doc.doc_id, doc.doc_version, label, "full", {"press": "x"}, FP, refs, time.time(),
                            doc.n_tokens, mode)
        store.commit_version(ver)
    return ver


# Every gc run of the attack suite: (case, objects a trusted record referenced that gc deleted);
# tests/test_attack_total.py sums it over the run.
GC_CASES: list[tuple[str, int]] = []
