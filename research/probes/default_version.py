"""One document of the example corpus stored at the shipped default, for the decode probes."""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ttft import corpus_text  # noqa: E402

from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.format.bundle import decode_bundle  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def default_store(lm, n_tokens: int, folder: Path):
    """``(store, doc_id)``: ``n_tokens`` tokens of the example corpus (as ``bench/ttft.py`` builds
    them) ingested into a store in ``folder`` and compressed with no options (``--budget 0.25``)
    as the version ``default``."""
    store = Store(Path(folder) / "store")
    text = corpus_text(lm.tokenizer, n_tokens)
    doc = Document("bench.txt", text, "bench", hashlib.sha256(text.encode()).hexdigest())
    ingest_documents(store, lm, [doc], IngestOptions())
    with store.writer():
        compress_document(store, doc.doc_id, CompressRecipe(), lm=lm, label="default")
    return store, doc.doc_id


def default_bundles(lm, n_tokens: int) -> list:
    """The chunk bundles of ``default_store``'s version, read into memory (the store is gone after)."""
    with tempfile.TemporaryDirectory() as tmp:
        store, doc_id = default_store(lm, n_tokens, Path(tmp))
        bundles = [decode_bundle(store.read_object(c.object)) for c in store.get_version(doc_id, "default").chunks]
        store.close()
    return bundles
