"""Independent chunks in a store: listing, addressing, BM25 retrieval, loading for compose.

A chunk is addressed as ``DOC#INDEX`` (its index in the document's ``independent`` version) or
by a prefix (>= 6 hex chars) of its content hash (``chunk_content_hash``, shown by
``kdnctl show DOC``). Chunk texts come from the bundle meta (``text``), read from the
safetensors header only, so scoring a corpus never loads KV tensors.

BM25 (Okapi, k1=1.5, b=0.75) is pure Python: lower-cased word tokens, a short stop-word list,
idf = ln(1 + (N - df + 0.5) / (df + 0.5)). A chunk stored once but used by several documents
is one retrieval candidate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field

from ..format.bundle import KVBundle, decode_bundle
from ..errors import ModelMismatchError, NotFoundError, UsageError
from ..ingest.independent import HEADER_INDEX, LABEL
from ..store import ReadStore, read_bundle_meta

_WORD_RE = re.compile(r"\w+", re.UNICODE)
_STOP = frozenset(
    "a an and are as at be by did do does for from had has have how i in is it its of on or that the "
    "this to was were what when where which who whom why will with you your".split()
)
MIN_HASH_PREFIX = 6


@dataclass
class ChunkInfo:
    doc_id: str
    index: int
    content_hash: str
    object: str
    token_start: int
    token_end: int
    header_object: str
    header_hash: str
    nbytes: int = 0
    score: float = 0.0
    _text: str | None = field(default=None, repr=False)

    @property
    def id(self) -> str:
        return f"{self.doc_id}#{self.index}"

    @property
    def n_tokens(self) -> int:
        return self.token_end - self.token_start

    def text(self, store: ReadStore) -> str:
        if self._text is None:
            self._text = str(read_bundle_meta(store, self.object).get("text", ""))
        return self._text

    def as_dict(self) -> dict:
        return {"id": self.id, "hash": self.content_hash[:12], "tokens": self.n_tokens,
                "score": round(self.score, 4)}


def list_chunks(store: ReadStore, *, doc_id: str | None = None, fingerprint: str | None = None) -> list[ChunkInfo]:
    """Every independent chunk of the current document versions (document order)."""
    out = []
    for v in store.list_versions(doc_id):
        if v.label != LABEL or v.mode != "independent":
            continue
        if fingerprint is not None and v.fingerprint != fingerprint:
            continue
        header = next((c for c in v.chunks if c.index == HEADER_INDEX), None)
        if header is None:
            continue
        for c in sorted(v.chunks, key=lambda c: c.index):
            if c.index != HEADER_INDEX:
                out.append(ChunkInfo(v.doc_id, c.index, c.chain_hash, c.object, c.token_start, c.token_end,
                                     header.object, header.chain_hash, c.nbytes))
    return out


def resolve_chunks(store: ReadStore, ids: list[str], *, doc_id: str | None = None, fingerprint: str | None = None) -> list[ChunkInfo]:
    """Chunks named by ``DOC#INDEX``, a content-hash prefix, or (with ``doc_id``) a bare index."""
    wanted = [i.strip() for i in ids if i.strip()]
    if not wanted:
        raise UsageError("chunks is empty", hint="give DOC#INDEX or content-hash prefixes, comma-separated", param="chunks")
    everything = list_chunks(store, fingerprint=fingerprint)
    if not everything:
        raise NotFoundError("the store has no independent chunks",
                            hint="ingest with `kdnctl ingest --mode independent`")
    by_id = {c.id: c for c in everything}
    out = []
    for ref in wanted:
        if doc_id is not None and ref.isdigit():
            ref = f"{doc_id}#{ref}"
        if ref in by_id:
            out.append(by_id[ref])
            continue
        if "#" in ref:
            doc, _, idx = ref.rpartition("#")
            known = sum(1 for c in everything if c.doc_id == doc)
            raise NotFoundError(f"no independent chunk {ref!r}" + (f" ({doc} has chunks 0..{known - 1})" if known else
                                                                   f" (no independent version of {doc!r})"))
        h = ref.lower()
        if len(h) < MIN_HASH_PREFIX or not re.fullmatch(r"[0-9a-f]+", h):
            raise UsageError(f"chunk id {ref!r} is neither DOC#INDEX nor a content-hash prefix (>= {MIN_HASH_PREFIX} hex chars)")
        hits = {c.content_hash: c for c in everything if c.content_hash.startswith(h)}
        if not hits:
            raise NotFoundError(f"no independent chunk with content hash {h}...")
        if len(hits) > 1:
            raise UsageError(f"content-hash prefix {h} is ambiguous ({len(hits)} chunks)", hint="give more characters")
        out.append(next(iter(hits.values())))
    return out


def tokenize(text: str) -> list[str]:
    return [w for w in _WORD_RE.findall(text.lower()) if w not in _STOP]


class BM25:
    """Okapi BM25 over a fixed list of documents (each a list of terms)."""

    def __init__(self, docs: list[list[str]], k1: float = 1.5, b: float = 0.75):
        self.k1, self.b = k1, b
        self.tf = [Counter(d) for d in docs]
        self.len = [len(d) for d in docs]
        self.avg = (sum(self.len) / len(docs)) if docs else 0.0
        df = Counter(t for d in self.tf for t in d)
        n = len(docs)
        self.idf = {t: math.log(1.0 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def scores(self, query: list[str]) -> list[float]:
        out = []
        for tf, n in zip(self.tf, self.len):
            s = 0.0
            norm = self.k1 * (1 - self.b + self.b * n / self.avg) if self.avg else self.k1
            for t in query:
                f = tf.get(t)
                if f:
                    s += self.idf[t] * f * (self.k1 + 1) / (f + norm)
            out.append(s)
        return out


def rank(store: ReadStore, question: str, chunks: list[ChunkInfo]) -> list[ChunkInfo]:
    """``chunks`` (deduplicated by content) scored against ``question``, best first."""
    unique: dict[str, ChunkInfo] = {}
    for c in chunks:
        unique.setdefault(c.content_hash, c)
    cands = list(unique.values())
    bm = BM25([tokenize(c.text(store)) for c in cands])
    for c, s in zip(cands, bm.scores(tokenize(question))):
        c.score = s
    return sorted(cands, key=lambda c: (-c.score, c.doc_id, c.index))


def retrieve(store: ReadStore, question: str, k: int, *, doc_id: str | None = None, fingerprint: str | None = None) -> list[ChunkInfo]:
    """The ``k`` independent chunks that best match ``question`` (BM25), best first."""
    if k < 1:
        raise UsageError(f"retrieve must be >= 1, got {k}", param="retrieve")
    chunks = list_chunks(store, doc_id=doc_id, fingerprint=fingerprint)
    if not chunks:
        raise NotFoundError("the store has no independent chunks" + (f" for {doc_id!r}" if doc_id else ""),
                            hint="ingest with `kdnctl ingest --mode independent`")
    return rank(store, question, chunks)[:k]


def load_chunk_bundles(lm: LoadedModel, store: ReadStore, chunks: list[ChunkInfo]) -> tuple[KVBundle, list[KVBundle], int]:
    """(header bundle, chunk bundles in the given order, bytes read) for ``compose``."""
    if not chunks:
        raise UsageError("no chunks to load")
    headers = {c.header_hash for c in chunks}
    if len(headers) > 1:
        raise UsageError("the chunks were prefilled after different prompt headers and cannot be composed")
    read = 0

    def load(sha: str) -> KVBundle:
        nonlocal read
        data = store.read_object(sha)
        read += len(data)
        return decode_bundle(data, expect_fingerprint=lm.fingerprint)

    try:
        header = load(chunks[0].header_object)
        bundles = [load(c.object) for c in chunks]
    except ModelMismatchError as exc:
        raise ModelMismatchError(exc.message, hint="compose with the model the chunks were ingested with") from None
    return header, bundles, read


def compose_chunks(lm: LoadedModel, store: ReadStore, chunks: list[ChunkInfo], suffix_ids: list[int], recompute: float, *, info: dict | None = None):
    """Load ``chunks`` from ``store`` and compose them (kdnctl.engine.independent). Returns a
    LoadedContext with ``load_s`` and ``nbytes`` set."""
    from .independent import compose

    t = time.perf_counter()
    header, bundles, nbytes = load_chunk_bundles(lm, store, chunks)
    loaded = time.perf_counter() - t
    ctx = compose(lm, bundles, header, suffix_ids, recompute=recompute, info=info)
    ctx.load_s, ctx.nbytes = loaded, nbytes
    ctx.doc_id = ",".join(sorted({c.doc_id for c in chunks}))
    return ctx
