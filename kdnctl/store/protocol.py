"""ReadStore: what the loader, retrieval and the server need from a store, local or remote.

``Store`` (local LMDB + objects) and ``RemoteStore`` (HTTP client) both implement it; code that
only reads takes a ReadStore and never probes for methods. A store that can hand out object
paths (only the local one) additionally satisfies ``LocalObjects``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from .records import ChunkRef, DocumentRecord, VersionRecord


@runtime_checkable
class ReadStore(Protocol):
    def get_document(self, doc_id: str, doc_version: str | None = None) -> DocumentRecord: ...

    def document_history(self, doc_id: str) -> list[DocumentRecord]: ...

    def find_document(self, doc_id: str, content_sha256: str) -> DocumentRecord | None: ...

    def list_documents(self) -> list[DocumentRecord]: ...

    def get_version(self, doc_id: str, label: str = "full", doc_version: str | None = None) -> VersionRecord: ...

    def list_versions(self, doc_id: str | None = None) -> list[VersionRecord]: ...

    def lookup_chunk(self, fingerprint: str, label: str, chain_hash: str) -> tuple[VersionRecord, ChunkRef] | None: ...

    def chunk_sizes(self) -> list[int]: ...

    def has_object(self, sha: str) -> bool: ...

    def read_object(self, sha: str, *, verify: bool = True) -> bytes: ...

    def read_object_head(self, sha: str, n: int) -> bytes:
        """The first ``n`` bytes of an object (a bundle header); remote stores may return more."""
        ...


@runtime_checkable
class LocalObjects(Protocol):
    """Optional capability: objects are files this process can open (the local Store)."""

    def object_path(self, sha: str) -> Path: ...


def read_bundle_meta(store: ReadStore, sha: str) -> dict:
    """A stored bundle's metadata without decoding its tensors: a local store reads only the
    header bytes; a remote one fetches (and verifies) the object. Damage -> BundleFormatError."""
    from kdnctl.format.bundle import decode_bundle, header_size, read_meta
    from kdnctl.errors import BundleFormatError

    try:
        head = store.read_object_head(sha, 1 << 16)
        n = header_size(head)
        if n > len(head):
            head = store.read_object_head(sha, n)
        return read_meta(head)
    except BundleFormatError:
        return decode_bundle(store.read_object(sha)).meta  # the full decoder names the damage
