"""``kdnctl ingest``: documents -> tokens -> prefill -> per-chunk bundles -> store.

Each document is committed in one catalog transaction after all its objects are on disk, so a
crash (even SIGKILL) leaves at most unreferenced objects that ``gc`` removes; re-running skips
every document already committed, which is what makes ingest resumable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..format.bundle import QUERY_ENERGY, STATS_PREFIX, KVBundle, chunk_tensors, make_meta, tensor_bytes

from ..format.names import tensor_name
from .chunking import chain_hashes, chunk_bounds
from .corpus import Document, Skipped, read_corpus
from ..errors import UsageError
from ..engine.prefill import BLOCK_TOKENS, prefill
from .prompting import PromptFormat
from ..store import DocumentRecord, Store, VersionRecord
from ..versions import commit, write_chunks

# What the default recipe needs (the hybrid scorer: surprisal; snapkv: the last window's
# attention, which costs a few query rows). ``accum`` (every query's attention, for h2o and
# adaptive budgets) is opt-in with ``--stats all``, or computed later by ``kdnctl compress``
# when a press asks for it (one extra prefill, see kdnctl.compress.document).
DEFAULT_STATS = ("surprisal", "window")
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class IngestOptions:
    chunk_tokens: int = 256
    window: int = 32
    stats: bool = True
    block_tokens: int = BLOCK_TOKENS
    stat_names: tuple[str, ...] = DEFAULT_STATS  # which statistics when ``stats``
    kv_dtype: str | None = None  # stored K/V dtype; None = the model's dtype

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise UsageError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}", param="chunk_tokens")
        from ..engine.prefill import stat_names

        if not isinstance(self.window, int) or self.window < 1:
            raise UsageError(f"window must be an integer >= 1, got {self.window}", param="window")
        self.stat_names = tuple(sorted(stat_names(self.stat_names)))
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise UsageError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")

    @property
    def stats_wanted(self) -> tuple[str, ...]:
        return self.stat_names if self.stats else ()

    def recipe(self) -> dict:
        r = {"step": "ingest", "chunk_tokens": self.chunk_tokens, "window": self.window, "stats": self.stats}
        if self.stats:
            r["stat_names"] = list(self.stat_names)
        if self.kv_dtype is not None:
            r["kv_dtype"] = self.kv_dtype
        return r

    def version_key(self) -> str:
        """What, beyond text/model/header, the stored bytes depend on (for ``doc_version_for``)."""
        return version_key_of(self.recipe())


@dataclass
class IngestReport:
    ingested: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    segments: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    seconds: float = 0.0
    kv_bytes: int = 0
    stats_bytes: int = 0
    prefill_seconds: float = 0.0  # the forward pass with its statistics
    write_seconds: float = 0.0  # bundles: slice, encode, hash, write + fsync

    def count_bytes(self, bundles: list[KVBundle]) -> None:
        for b in bundles:
            self.kv_bytes += tensor_bytes(b.tensors, "layers.")
            self.stats_bytes += tensor_bytes(b.tensors, STATS_PREFIX) + tensor_bytes(b.tensors, QUERY_ENERGY)

    def add(self, seg: "SegmentResult") -> None:
        """Count a committed segment."""
        self.ingested.append(seg.record.doc_id)
        self.tokens += seg.tokens
        self.kv_bytes += seg.kv_bytes
        self.stats_bytes += seg.stats_bytes
        self.prefill_seconds += seg.prefill_seconds
        self.write_seconds += seg.write_seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return {
            "ingested": self.ingested,
            "unchanged": self.unchanged,
            "skipped": [{"path": s.path, "reason": s.reason} for s in self.skipped],
            "tokens": self.tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "kv_bytes": self.kv_bytes,
            "stats_bytes": self.stats_bytes,
            "stats_fraction": round(self.stats_bytes / self.kv_bytes, 4) if self.kv_bytes else 0.0,
        }


def version_key_of(recipe: dict) -> str:
    """What, beyond text/model/header, the stored bytes depend on, from the ingest recipe stored
    in every full bundle (``IngestOptions.recipe()``): ingest and ``rebuild-catalog`` both derive
    the document version through this one function."""
    stats = bool(recipe.get("stats", True))
    key = f"{recipe['chunk_tokens']}|{recipe['window']}|{stats}"
    names = tuple(recipe.get("stat_names") or ())
    if stats and names != tuple(sorted(("accum", "surprisal", "window"))):
        key += "|" + ",".join(names)
    if recipe.get("kv_dtype") is not None:
        key += f"|kv={recipe['kv_dtype']}"
    return key


def doc_version_of(content_sha256: str, fingerprint: str, recipe: dict, header: str) -> str:
    """A document version is what its bundles depend on: text, model, ingest recipe, prompt header."""
    key = f"{content_sha256}|{fingerprint}|{version_key_of(recipe)}|{header}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def doc_version_for(doc: Document, fingerprint: str, opts: IngestOptions, header: str) -> str:
    return doc_version_of(doc.content_sha256, fingerprint, opts.recipe(), header)


def _segments(ids: list[int], n_header: int, max_positions: int | None) -> list[list[int]]:
    """Split a document longer than the model's context into independent segments, each
    starting with the prompt header again (positions restart at 0 in each)."""
    if not max_positions or len(ids) <= max_positions:
        return [ids]
    header, body = ids[:n_header], ids[n_header:]
    room = max_positions - n_header - 512  # leave room for a question and an answer
    return [header + body[s : s + room] for s in range(0, len(body), room)]


def build_chunk_bundles(
    lm, doc_id: str, doc_version: str, token_ids: list[int], result, opts: IngestOptions, recipe: dict,
    header_tokens: int = 0, document: dict | None = None,
) -> list[KVBundle]:
    """``document``: the document record's ``content_sha256`` and ``text_object``, kept in every
    bundle so that `rebuild-catalog` and `verify` can tie the bundles to their text."""
    bounds = chunk_bounds(len(token_ids), opts.chunk_tokens)
    hashes = chain_hashes(token_ids, opts.chunk_tokens, lm.fingerprint)
    kv_dtype = KV_DTYPES[opts.kv_dtype] if opts.kv_dtype else None
    bundles = []
    for index, ((s, e), h) in enumerate(zip(bounds, hashes)):
        tensors = chunk_tensors(result, s, e, token_ids[s:e], s)
        if result.query_energy is not None:
            tensors[QUERY_ENERGY] = result.query_energy[index].clone()
        if kv_dtype is not None:  # --kv-dtype: the stored K/V dtype
            for layer in range(len(result.keys)):
                for role in ("keys", "values"):
                    name = tensor_name(layer, role)
                    tensors[name] = tensors[name].to(kv_dtype)
        meta = make_meta(
            model_fingerprint=lm.fingerprint,
            model=lm.summary,
            doc_id=doc_id,
            doc_version=doc_version,
            chunk_index=index,
            n_chunks=len(bounds),
            token_start=s,
            token_end=e,
            chain_hash=h,
            label="full",
            parent=None,
            recipe=recipe,
            dtype=opts.kv_dtype or lm.summary["dtype"],
            mode="prefix",
            header_tokens=header_tokens,
            **(document or {}),
        )
        bundles.append(KVBundle(meta=meta, tensors=tensors))
    return bundles


@dataclass
class Segment:
    """What one catalog document is made of: a whole document, or one segment of a document
    longer than the model's context (``doc#1``, ``doc#2`` ...)."""

    seg_id: str
    doc_version: str
    token_ids: list[int]
    header_tokens: int
    text: str


@dataclass
class SegmentResult:
    """A segment whose objects are written; ``record`` and ``version`` await one catalog commit."""

    record: DocumentRecord
    version: VersionRecord
    tokens: int
    kv_bytes: int
    stats_bytes: int
    prefill_seconds: float = 0.0
    write_seconds: float = 0.0


def document_segments(lm: LoadedModel, fmt: PromptFormat, doc: Document, opts: IngestOptions) -> list[Segment]:
    ids, n_header = fmt.document_ids(lm.tokenizer, doc.text)
    segments = _segments(ids, n_header, lm.summary.get("max_positions"))
    version = doc_version_for(doc, lm.fingerprint, opts, fmt.header)
    out = []
    for seg_index, seg_ids in enumerate(segments):
        seg_id = doc.doc_id if len(segments) == 1 else f"{doc.doc_id}#{seg_index + 1}"
        text = doc.text if len(segments) == 1 else lm.tokenizer.decode(seg_ids[n_header:])
        out.append(Segment(seg_id, version, seg_ids, n_header, text))
    return out


def is_current(store, seg_id: str, doc_version: str) -> bool:
    """This segment is already committed at this version (re-running skips it)."""
    if any(d.doc_version == doc_version for d in store.document_history(seg_id)):
        return store.get_document(seg_id).doc_version == doc_version
    return False


def write_segment(objects, lm: LoadedModel, doc: Document, seg: Segment, opts: IngestOptions, *,
                  on_progress: Callable[[int], None] | None = None) -> SegmentResult:
    """Prefill one segment and put its chunk bundles and text into ``objects`` (a Store or an
    ObjectDir); no catalog access, so a worker process can run it and a driver commit it."""
    recipe = opts.recipe()
    t_pass = time.perf_counter()
    # with statistics, each chunk's squared queries too: compress's key weights without a forward
    result = prefill(lm.model, seg.token_ids, stats=opts.stats_wanted, window=opts.window,
                     block_tokens=opts.block_tokens, on_progress=on_progress,
                     energy_chunk=opts.chunk_tokens if opts.stats else None)
    t_write = time.perf_counter()
    text = seg.text.encode("utf-8")
    document = {"content_sha256": doc.content_sha256, "text_object": hashlib.sha256(text).hexdigest()}
    bundles = build_chunk_bundles(lm, seg.seg_id, seg.doc_version, seg.token_ids, result, opts, recipe,
                                  seg.header_tokens, document)
    chunks = write_chunks(objects, bundles)
    sizes = IngestReport()
    sizes.count_bytes(bundles)
    text_sha = objects.put_object(text)
    now = time.time()
    n = len(seg.token_ids)
    record = DocumentRecord(seg.seg_id, seg.doc_version, doc.content_sha256, doc.source, n,
                            lm.fingerprint, text_sha, now)
    vrec = VersionRecord(seg.seg_id, seg.doc_version, "full", None, recipe, lm.fingerprint, chunks, now, n, "prefix")
    return SegmentResult(record, vrec, n, sizes.kv_bytes, sizes.stats_bytes,
                         prefill_seconds=t_write - t_pass, write_seconds=time.perf_counter() - t_write)


def ingest_documents(
    store: Store,
    lm: LoadedModel,
    docs: list[Document],
    opts: IngestOptions,
    *,
    on_progress: Callable[[int], None] | None = None,
    on_doc: Callable[[str, str], None] | None = None,
) -> IngestReport:
    report = IngestReport()
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    t0 = time.perf_counter()
    with store.writer():
        for doc in docs:
            for seg in document_segments(lm, fmt, doc, opts):
                if is_current(store, seg.seg_id, seg.doc_version):
                    report.unchanged.append(seg.seg_id)
                    if on_progress:
                        on_progress(len(seg.token_ids))
                    continue
                res = write_segment(store, lm, doc, seg, opts, on_progress=on_progress)
                commit(store, res.version, res.record)
                report.add(res)
                if on_doc:
                    on_doc(seg.seg_id, "ingested")
    report.seconds = time.perf_counter() - t0
    return report


def ingest_paths(store: Store, lm: LoadedModel, paths: list[str | Path], opts: IngestOptions, **kw) -> IngestReport:
    docs, skipped = read_corpus(paths)
    report = ingest_documents(store, lm, docs, opts, **kw)
    report.skipped = skipped
    return report
