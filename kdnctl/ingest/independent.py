"""``kdnctl ingest --mode independent``: composable chunks for RAG-style reuse.

Prefix mode stores chunk i's KV as computed after chunks 0..i-1, so it is only reusable
behind exactly that prefix. Independent mode prefills every chunk ON ITS OWN, right after the
shared prompt header (the chat template's part before the user content), so a chunk's KV
depends only on (model, header, its own tokens) and can be placed anywhere in a new prompt by
``kdnctl.engine.independent`` (RoPE re-rotation + optional selective recompute).

Storage:

* the header's KV is one bundle, stored once (content-addressed) and referenced by every
  independent version as its chunk ``index -1`` (so ``gc`` and ``verify`` see it);
* chunk bundles are keyed by ``chunk_content_hash(token_ids, fingerprint)`` (the ``chain_hash``
  field of the ChunkRef, so ``Store.lookup_chunk(fp, "independent", hash)`` finds them); a chunk
  already stored (same tokens, same model, same header) is reused, never stored twice;
* chunk bundle meta is document-neutral (the same object may serve several documents) and
  records ``text`` (the decoded chunk) and ``header_hash`` for retrieval and safety checks;
  positions are where the chunk sat when prefilled: ``header_len .. header_len + n``;
* the version label is ``independent`` (mode ``"independent"``), next to a document's prefix
  ``full`` version when the same document text is already stored.

Chunk boundaries follow paragraphs: whole paragraphs are packed greedily up to
``chunk_tokens``; a longer paragraph is split at sentence/line ends, and a longer sentence into
plain token windows. Every piece is tokenized on its own, so equal paragraphs give equal tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

import hashlib
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..format.bundle import KVBundle, chunk_tensors, make_meta
from .chunking import chunk_content_hash
from .corpus import Document, read_corpus
from ..errors import NotFoundError, UnsupportedError, UsageError
from .prefix import IngestOptions, IngestReport, doc_version_for
from ..engine.prefill import prefill
from .prompting import PromptFormat
from ..store import ChunkRef, DocumentRecord, ReadStore, Store, VersionRecord
from ..store import read_bundle_meta as store_bundle_meta
from ..versions import commit, write_chunk

LABEL = "independent"
MODE = "independent"
HEADER_INDEX = -1  # ChunkRef index of the shared header inside an independent version
SPLITTER = "paragraph-v1"

_PARAGRAPH_RE = re.compile(r"\n[ \t]*\n+")
# A split point after a sentence end (followed by whitespace) or before a line break.
_SENTENCE_END_RE = re.compile(r"(?<=[.!?:;])(?=\s)|(?=\n)")


# -- chunk boundaries -------------------------------------------------------------------------

def _pieces(tokenizer, text: str, budget: int) -> list[list[int]]:
    """Token ids of the text's units: paragraphs, or sentences/lines of long paragraphs, or
    token windows of overlong sentences. Each unit ends a paragraph with "\\n\\n"."""
    encode = lambda t: list(tokenizer(t, add_special_tokens=False).input_ids)  # noqa: E731
    units: list[list[int]] = []
    for para in (p.strip() for p in _PARAGRAPH_RE.split(text)):
        if not para:
            continue
        ids = encode(para + "\n\n")
        if len(ids) <= budget:
            units.append(ids)
            continue
        cuts = sorted({0, len(para), *(m.start() for m in _SENTENCE_END_RE.finditer(para))})
        segments = [para[a:b] for a, b in zip(cuts, cuts[1:]) if para[a:b].strip()]
        for i, seg in enumerate(segments):
            seg_ids = encode(seg + ("\n\n" if i == len(segments) - 1 else ""))
            units.extend(seg_ids[s : s + budget] for s in range(0, len(seg_ids), budget))
    return units


def split_chunks(tokenizer, text: str, chunk_tokens: int) -> list[list[int]]:
    """Token ids of each independent chunk (<= chunk_tokens each), in document order."""
    if chunk_tokens < 1:
        raise UsageError(f"chunk_tokens must be >= 1, got {chunk_tokens}", param="chunk_tokens")
    chunks: list[list[int]] = []
    current: list[int] = []
    for unit in _pieces(tokenizer, text, chunk_tokens):
        if current and len(current) + len(unit) > chunk_tokens:
            chunks.append(current)
            current = []
        current = current + unit
    if current:
        chunks.append(current)
    return chunks


# -- bundles ----------------------------------------------------------------------------------

def _bundle(lm: LoadedModel, token_ids: list[int], result, start: int, *, chash: str, role: str,
            header_hash: str | None, text: str, recipe: dict) -> KVBundle:
    """A bundle of tokens [start, start+n) of ``result`` (header + chunk prefill)."""
    n = len(token_ids)
    tensors = chunk_tensors(result, start, start + n, token_ids, start)
    meta = make_meta(
        model_fingerprint=lm.fingerprint, model=lm.summary,
        # Document-neutral: one stored chunk can belong to several documents.
        doc_id=f"{role}-{chash[:16]}", doc_version=chash[:16], chunk_index=0, n_chunks=1,
        token_start=start, token_end=start + n, chain_hash=chash, label=LABEL, parent=None,
        recipe=recipe, dtype=lm.summary["dtype"], mode=MODE, role=role, text=text,
        header_hash=header_hash,
    )
    return KVBundle(meta=meta, tensors=tensors)


def read_bundle_meta(store: ReadStore, sha: str) -> dict:
    """A stored bundle's meta without decoding its tensors (kdnctl.store.read_bundle_meta)."""
    return store_bundle_meta(store, sha)


@dataclass
class IndependentReport(IngestReport):
    chunks_stored: int = 0
    chunks_reused: int = 0
    header_object: str = ""
    header_tokens: int = 0

    def as_dict(self) -> dict:
        d = super().as_dict()
        d.update(mode=MODE, chunks_stored=self.chunks_stored, chunks_reused=self.chunks_reused,
                 header_object=self.header_object, header_tokens=self.header_tokens)
        return d


@dataclass
class _Ctx:
    store: Store
    lm: object
    opts: IngestOptions
    recipe: dict
    header_ids: list[int]
    header_hash: str = ""
    report: IndependentReport = field(default_factory=IndependentReport)
    seen: dict[str, tuple[str, int]] = field(default_factory=dict)  # content hash -> (object, nbytes)

    def put(self, b: KVBundle) -> tuple[str, int]:
        ref = write_chunk(self.store, b)
        self.report.count_bytes([b])
        return ref.object, ref.nbytes

    def existing(self, chash: str, want_header: str | None) -> tuple[str, int] | None:
        """An object already holding this chunk (this run, or the store), made after the same header."""
        if chash in self.seen:
            return self.seen[chash]
        hit = self.store.lookup_chunk(self.lm.fingerprint, LABEL, chash)
        if hit is None or not self.store.has_object(hit[1].object):
            return None
        if read_bundle_meta(self.store, hit[1].object).get("header_hash") != want_header:
            return None
        self.seen[chash] = (hit[1].object, hit[1].nbytes)
        return self.seen[chash]

    def header_ref(self) -> ChunkRef:
        h = len(self.header_ids)
        self.header_hash = chunk_content_hash(self.header_ids, self.lm.fingerprint)
        found = self.existing(self.header_hash, None)
        if found is None:
            result = prefill(self.lm.model, self.header_ids, stats=False)
            text = self.lm.tokenizer.decode(self.header_ids)
            b = _bundle(self.lm, self.header_ids, result, 0, chash=self.header_hash, role="header",
                        header_hash=None, text=text, recipe=self.recipe)
            found = self.seen[self.header_hash] = self.put(b)
        self.report.header_object, self.report.header_tokens = found[0], h
        return ChunkRef(HEADER_INDEX, found[0], 0, h, self.header_hash, found[1])

    def chunk_ref(self, index: int, ids: list[int], on_progress) -> ChunkRef:
        h = len(self.header_ids)
        chash = chunk_content_hash(ids, self.lm.fingerprint)
        found = self.existing(chash, self.header_hash)
        if found is not None:
            self.report.chunks_reused += 1
        else:
            result = prefill(self.lm.model, self.header_ids + ids, stats=self.opts.stats_wanted,
                             window=self.opts.window, block_tokens=self.opts.block_tokens)
            b = _bundle(self.lm, ids, result, h, chash=chash, role="chunk", header_hash=self.header_hash,
                        text=self.lm.tokenizer.decode(ids), recipe=self.recipe)
            found = self.seen[chash] = self.put(b)
            self.report.chunks_stored += 1
            self.report.tokens += len(ids)
        if on_progress:
            on_progress(len(ids))
        return ChunkRef(index, found[0], h, h + len(ids), chash, found[1])


def independent_recipe(opts: IngestOptions) -> dict:
    return {**opts.recipe(), "mode": MODE, "splitter": SPLITTER}


def _current(store: Store, doc_id: str) -> DocumentRecord | None:
    try:
        return store.get_document(doc_id)
    except NotFoundError:
        return None


def ingest_independent(store: Store, lm: LoadedModel, docs: list[Document], opts: IngestOptions, *,
                       on_progress: Callable[[int], None] | None = None,
                       on_doc: Callable[[str, str], None] | None = None) -> IndependentReport:
    """Store every document's chunks as independently prefilled bundles (label ``independent``)."""
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    recipe = independent_recipe(opts)
    c = _Ctx(store, lm, opts, recipe, fmt.header_ids(lm.tokenizer))
    if not c.header_ids:
        raise UnsupportedError("independent chunks need a prompt header (chat template or BOS token); this tokenizer has none")
    max_pos = lm.summary.get("max_positions")
    if max_pos and len(c.header_ids) + opts.chunk_tokens > max_pos:
        raise UsageError(f"chunk_tokens {opts.chunk_tokens} plus the header exceeds the model's {max_pos} positions",
                         param="chunk_tokens")
    t0 = time.perf_counter()
    with store.writer():
        header = c.header_ref()
        for doc in docs:
            cur = _current(store, doc.doc_id)
            same_text = cur is not None and cur.content_sha256 == doc.content_sha256 and cur.fingerprint == lm.fingerprint
            if same_text:
                try:
                    old = store.get_version(doc.doc_id, LABEL)
                    if old.recipe == recipe and any(r.chain_hash == c.header_hash for r in old.chunks):
                        c.report.unchanged.append(doc.doc_id)
                        if on_progress:
                            on_progress(old.n_tokens - len(c.header_ids))
                        continue
                except NotFoundError:
                    pass
            chunks = split_chunks(lm.tokenizer, doc.text, opts.chunk_tokens)
            refs = [header] + [c.chunk_ref(i, ids, on_progress) for i, ids in enumerate(chunks)]
            n_tokens = len(c.header_ids) + sum(len(ids) for ids in chunks)
            now = time.time()
            if same_text:  # attach next to the document's other labels (e.g. prefix "full")
                version = cur.doc_version
            else:
                base = doc_version_for(doc, lm.fingerprint, opts, fmt.header)
                version = hashlib.sha256(f"{MODE}|{SPLITTER}|{base}".encode()).hexdigest()[:16]
            vrec = VersionRecord(doc.doc_id, version, LABEL, None, recipe, lm.fingerprint, refs, now,
                                 n_tokens, MODE)
            record = None
            if not same_text:
                text_sha = store.put_object(doc.text.encode("utf-8"))
                record = DocumentRecord(doc.doc_id, version, doc.content_sha256, doc.source, n_tokens,
                                        lm.fingerprint, text_sha, now)
            commit(store, vrec, record)
            c.report.ingested.append(doc.doc_id)
            if on_doc:
                on_doc(doc.doc_id, "ingested")
    c.report.seconds = time.perf_counter() - t0
    return c.report


def ingest_paths_independent(store: Store, lm: LoadedModel, paths: list[str | Path], opts: IngestOptions, **kw) -> IndependentReport:
    docs, skipped = read_corpus(paths)
    report = ingest_independent(store, lm, docs, opts, **kw)
    report.skipped = skipped
    return report
