"""Catalog records (documents, versions, chunk references) and their one validating decoder.

The same ``from_dict`` reads records from the local LMDB catalog and from a remote server's
JSON, so a flipped byte in the catalog or a hostile server can only ever produce a
StoreCorruptError naming the bad field, never a TypeError deep inside the loader.
Schemas are additive: unknown fields (written by a newer kdnctl) are ignored.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from kdnctl.errors import StoreCorruptError, UsageError

SHA_RE = re.compile(r"^[0-9a-f]{64}$")
XXH3_RE = re.compile(r"^[0-9a-f]{32}$")
SEP = "\x00"  # catalog key separator; ids are checked not to contain it
MAX_ID_BYTES = {"doc_id": 200, "doc_version": 64, "label": 64}  # LMDB keys are <= 511 bytes
MAX_FINGERPRINT = 128
MODES = ("prefix", "independent")
HEADER_INDEX = -1  # the shared prompt header of an independent version


def is_sha(value: Any) -> bool:
    return isinstance(value, str) and SHA_RE.match(value) is not None


def check_sha(value: Any, what: str = "object id") -> str:
    """``value`` if it is 64 lowercase hex characters, else UsageError (keeps "../x" out of paths)."""
    if not is_sha(value):
        raise UsageError(f"invalid {what} {str(value)[:80]!r}: expected 64 lowercase hex chars")
    return value


def id_problem(kind: str, value: Any) -> str | None:
    """Why ``value`` is not a valid doc_id / doc_version / label, or None."""
    if not isinstance(value, str) or not value:
        return f"invalid {kind} {value!r}: must be a non-empty string"
    if SEP in value:
        return f"invalid {kind} {value[:40]!r}: must not contain NUL"
    try:
        n = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return f"invalid {kind} {value[:40]!r}: not valid UTF-8 (lone surrogate)"
    if n > MAX_ID_BYTES[kind]:
        return f"{kind} {value[:40]!r}... is longer than {MAX_ID_BYTES[kind]} bytes"
    return None


def check_id(kind: str, value: Any) -> str:
    problem = id_problem(kind, value)
    if problem:
        raise UsageError(problem)
    return value


@dataclass
class ChunkRef:
    index: int
    object: str
    token_start: int
    token_end: int
    chain_hash: str
    nbytes: int
    # BLAKE3 of the object's bytes, recorded at write time beside its sha256 name: a
    # reader that has it checks every byte at BLAKE3 speed; older catalogs simply lack it.
    blake3: str | None = None
    # XXH3-128 of the object's bytes (32 hex), recorded at write time: the at-rest check of LOCAL
    # reads (kdnctl/store/fastread.py; corruption, not tampering: remote clients check BLAKE3/sha256).
    xxh3: str | None = None

    @classmethod
    def from_dict(cls, d: Any, where: str = "chunk") -> "ChunkRef":
        f = _Fields(d, where)
        index = f.int("index", minimum=HEADER_INDEX)
        start = f.int("token_start")
        end = f.int("token_end", minimum=start)
        b3 = d.get("blake3")
        if b3 is not None and not is_sha(b3):  # 32-byte digest: 64 lowercase hex, like a sha256
            f.bad("blake3", b3, "null or 64 lowercase hex characters")
        xx = d.get("xxh3")
        if xx is not None and not (isinstance(xx, str) and XXH3_RE.match(xx)):
            f.bad("xxh3", xx, "null or 32 lowercase hex characters")
        return cls(index, f.sha("object"), start, end, f.sha("chain_hash"), f.int("nbytes"), b3, xx)


@dataclass
class DocumentRecord:
    doc_id: str
    doc_version: str
    content_sha256: str
    source: str
    n_tokens: int
    fingerprint: str
    text_object: str
    created: float

    @classmethod
    def from_dict(cls, d: Any, where: str = "document record") -> "DocumentRecord":
        f = _Fields(d, where)
        return cls(f.id("doc_id"), f.id("doc_version"), f.sha("content_sha256"), f.str("source"),
                   f.int("n_tokens"), f.fingerprint(), f.sha("text_object"), f.number("created"))


@dataclass
class VersionRecord:
    doc_id: str
    doc_version: str
    label: str
    parent: str | None
    recipe: dict
    fingerprint: str
    chunks: list[ChunkRef]
    created: float
    n_tokens: int
    mode: str = "prefix"

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def chunk(self, index: int) -> ChunkRef | None:
        return next((c for c in self.chunks if c.index == index), None)

    @classmethod
    def from_dict(cls, d: Any, where: str = "version record") -> "VersionRecord":
        f = _Fields(d, where)
        doc_id, dv, label = f.id("doc_id"), f.id("doc_version"), f.id("label")
        where = f.where = f"{where} {doc_id}@{dv}/{label}"
        parent = f.get("parent")
        if parent is not None and id_problem("label", parent):
            f.bad("parent", parent, "a label or null")
        recipe = f.get("recipe")
        if not isinstance(recipe, dict):
            f.bad("recipe", recipe, "an object")
        raw_chunks = f.get("chunks")
        if not isinstance(raw_chunks, list):
            f.bad("chunks", raw_chunks, "a list")
        chunks = [ChunkRef.from_dict(c, f"{where} chunk #{i}") for i, c in enumerate(raw_chunks)]
        if len({c.index for c in chunks}) != len(chunks):
            raise StoreCorruptError(f"{where}: duplicate chunk indices", hint=CATALOG_HINT)
        mode = d.get("mode", "prefix")
        if mode not in MODES:
            f.bad("mode", mode, " or ".join(MODES))
        return cls(doc_id, dv, label, parent, recipe, f.fingerprint(), chunks, f.number("created"),
                   f.int("n_tokens"), mode)


# Where a damaged catalog sends the user (the CLI prints it as the hint).
CATALOG_HINT = ("the catalog is damaged and nothing was changed: restore STORE/catalog/ from a backup, or rebuild "
                "it from the bundles with `kdnctl rebuild-catalog` (the objects are intact); then run `kdnctl verify`")


class _Fields:
    """Typed field access that turns any wrong type or value into a StoreCorruptError."""

    def __init__(self, d: Any, where: str):
        if not isinstance(d, dict):
            raise StoreCorruptError(f"{where}: expected a JSON object, got {type(d).__name__}", hint=CATALOG_HINT)
        self.d, self.where = d, where

    def bad(self, name: str, value: Any, expected: str):
        raise StoreCorruptError(f"{self.where}: field {name!r} is {str(value)[:60]!r}, expected {expected}",
                                hint=CATALOG_HINT)

    def get(self, name: str) -> Any:
        if name not in self.d:
            raise StoreCorruptError(f"{self.where}: field {name!r} is missing", hint=CATALOG_HINT)
        return self.d[name]

    def int(self, name: str, minimum: int = 0) -> int:
        v = self.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum or v > 1 << 62:
            self.bad(name, v, f"an integer >= {minimum}")
        return v

    def number(self, name: str) -> float:
        v = self.get(name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            self.bad(name, v, "a number")
        return v

    def str(self, name: str) -> str:
        v = self.get(name)
        if not isinstance(v, str):
            self.bad(name, v, "a string")
        return v

    def sha(self, name: str) -> str:
        v = self.get(name)
        if not is_sha(v):
            self.bad(name, v, "64 lowercase hex characters")
        return v

    def id(self, kind: str) -> str:
        v = self.get(kind)
        if id_problem(kind, v):
            self.bad(kind, v, f"a non-empty id without NUL, at most {MAX_ID_BYTES[kind]} bytes")
        return v

    def fingerprint(self) -> str:
        v = self.get("fingerprint")
        if not isinstance(v, str) or not v or len(v) > MAX_FINGERPRINT or SEP in v:
            self.bad("fingerprint", v, "a model fingerprint string")
        return v


def record_dict(record: Any) -> dict:
    return dataclasses.asdict(record)


def bundle_mismatch(version: VersionRecord, chunk: ChunkRef, meta: dict) -> str | None:
    """Why a chunk's bundle metadata does not belong where ``version`` puts it, or None.

    Prefix bundles name their document, version, chunk index and label; independent chunks
    are shared between documents, so there the content (chain hash, tokens, model) must agree."""
    want: dict[str, Any] = {}
    if version.mode == "prefix":
        want.update(doc_id=version.doc_id, doc_version=version.doc_version, chunk_index=chunk.index)
    want.update(label=version.label, model_fingerprint=version.fingerprint, chain_hash=chunk.chain_hash,
                token_start=chunk.token_start, token_end=chunk.token_end)
    if not isinstance(meta, dict):
        meta = {}
    wrong = [f"{key}={str(meta.get(key))[:40]!r} (record: {str(value)[:40]!r})" for key, value in want.items()
             if meta.get(key) != value or type(meta.get(key)) is not type(value)]
    if not wrong:
        return None
    return (f"{version.doc_id}@{version.doc_version}/{version.label} chunk {chunk.index} points at object "
            f"{chunk.object[:12]} whose bundle has {', '.join(wrong[:3])}" + (" ..." if len(wrong) > 3 else ""))
