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


def decode_target(bundles) -> tuple[dict, list[int], tuple]:
    """``(quant meta, each chunk's first token, a zeroed float32 cache per role [L, H, T, D])``:
    what ``ec_batch`` decodes ``default_bundles`` into."""
    import numpy as np
    import torch

    q = bundles[0].meta["quant"]
    n_layers, h, d = bundles[0].n_layers, q["n_heads"], q["head_dim"]
    lens = [b.layer_len(0) for b in bundles]
    starts = [int(x) for x in np.cumsum([0] + lens[:-1])]
    return q, starts, tuple(torch.zeros(n_layers, h, sum(lens), d) for _ in range(2))


def rotating(timed, modes: tuple[str, ...], repeats: int) -> dict[str, list[float]]:
    """``timed(mode)`` of every mode once untimed (warm-up), then ``repeats`` rounds with the
    modes in rotating order (load from other jobs falls on all alike): each mode's seconds."""
    for m in modes:
        timed(m)
    res = {m: [] for m in modes}
    for rep in range(repeats):
        k = rep % len(modes)
        for m in modes[k:] + modes[:k]:
            res[m].append(timed(m))
    return res


def print_profile(fn, times: int = 5, top: int = 12) -> None:
    """A cProfile of ``fn()`` called ``times`` times, its ``top`` functions by internal time."""
    import cProfile
    import io
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(times):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    print(s.getvalue())
