"""One long document of the example corpus ingested for the refit probes."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ttft import corpus_text  # noqa: E402

from kdnctl.format.bundle import decode_bundle  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.quant import layer_kv  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def ingested(lm, n_tokens: int, folder: Path):
    """``(store, doc_id, token ids, keys, values)``: ``n_tokens`` tokens of the example corpus (as
    ``bench/ttft.py`` builds them) ingested into a store in ``folder``, with the full version's
    K/V per layer ``[H, T, D]`` (float32, as stored: keys after RoPE)."""
    text = corpus_text(lm.tokenizer, n_tokens)
    doc = Document("probe.txt", text, "probe", hashlib.sha256(text.encode()).hexdigest())
    store = Store(Path(folder) / "store")
    ingest_documents(store, lm, [doc], IngestOptions())
    bundles = [decode_bundle(store.read_object(c.object)) for c in store.get_version(doc.doc_id, "full").chunks]
    n_layers = bundles[0].n_layers
    dense = [[layer_kv(b, i) for i in range(n_layers)] for b in bundles]
    keys = [torch.cat([d[i][0] for d in dense], 1).float() for i in range(n_layers)]
    values = [torch.cat([d[i][1] for d in dense], 1).float() for i in range(n_layers)]
    ids = [int(t) for b in bundles for t in b.token_ids.tolist()]
    return store, doc.doc_id, ids, keys, values


def compress_watching_refit(store, doc_id: str, lm, watch) -> None:
    """A 0.083 compress of ``doc_id`` whose refit calls ``watch`` instead, with the arguments
    ``refit_values`` gets (``watch`` returns what the refit is to use)."""
    import kdnctl.compress.stages.refit as stage
    from kdnctl.compress.document import CompressRecipe, compress_document

    real = stage.refit_values
    stage.refit_values = watch
    try:
        with store.writer():
            compress_document(store, doc_id, CompressRecipe(budget=0.083), lm=lm, label="probe")
    finally:
        stage.refit_values = real
    store.close()


def print_row(row: dict) -> None:
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
