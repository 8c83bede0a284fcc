"""Spread bins one octave wide against half an octave, in one process: what the 0.25 default
stores, how many frames, how long its compress and its CPU decode take.

    python research/probes/octave_bins.py [--sizes 1024,8000] [--repeats 3]

For each size, one document of the example corpus (as ``bench/ttft.py`` builds it) is ingested,
then the default compress (``CompressRecipe()``) runs with ``SPREAD_BINS_PER_OCTAVE`` 2 and 1,
taking turns, each into a label of its own (a bare prefill between them). Each side's version is
then decoded by the batch decoder (``ec_batch.decode_into``, one worker), the sides taking turns.
Prints medians of ``--repeats``: stored bytes, code frames per role, compress seconds against the
bare prefill, decode CPU seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ttft import corpus_text  # noqa: E402

from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.compress.stages import payload_size  # noqa: E402
from kdnctl.engine.prefill import bare_prefill_seconds  # noqa: E402
from kdnctl.format.bundle import decode_bundle  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import ec_batch, entropy  # noqa: E402
from kdnctl.store import Store  # noqa: E402

SIDES = (2, 1)


def set_bins(per_octave: int) -> None:
    entropy.SPREAD_BINS_PER_OCTAVE = per_octave
    payload_size.SPREAD_BINS_PER_OCTAVE = per_octave


def frames(bundles, role: str) -> int:
    return sum(int(t[1]) for b in bundles for name, t in b.tensors.items() if name.endswith(f".{role}.codes"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,8000")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_model(dtype="float32")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    print(f"medians of {args.repeats}, the sides taking turns; one torch thread, one decode worker\n")
    print("| tokens | bins per octave | stored MB | / half-octave | key frames | value frames | compress s | "
          "compress / bare | decode CPU s | / half-octave |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        try:
            for size in (int(x) for x in args.sizes.split(",")):
                text = corpus_text(lm.tokenizer, size)
                doc = Document(f"d{size}.txt", text, "bench", hashlib.sha256(text.encode()).hexdigest())
                ingest_documents(store, lm, [doc], IngestOptions())
                ids = fmt.document_ids(lm.tokenizer, text)[0]
                times, bare, stored, bundles = {k: [] for k in SIDES}, [], {}, {}
                for rep in range(args.repeats + 1):
                    for side in (SIDES if rep % 2 else SIDES[::-1]):
                        set_bins(side)
                        label = f"o{side}-{rep}"
                        t = time.perf_counter()
                        with store.writer():
                            compress_document(store, doc.doc_id, CompressRecipe(), lm=lm, label=label)
                        if rep:  # (the first round compiles, and measures the store's key basis and profile)
                            times[side].append(time.perf_counter() - t)
                        chunks = store.get_version(doc.doc_id, label).chunks
                        stored[side] = sum(c.nbytes for c in chunks)
                        bundles[side] = [decode_bundle(store.read_object(c.object)) for c in chunks]
                    bare.append(bare_prefill_seconds(lm.model, ids))
                set_bins(SIDES[0])
                q = bundles[SIDES[0]][0].meta["quant"]
                n_layers = bundles[SIDES[0]][0].n_layers
                n_tok = sum(b.layer_len(0) for b in bundles[SIDES[0]])
                out = tuple(torch.empty(n_layers, q["n_heads"], n_tok, q["head_dim"]) for _ in range(2))
                starts = {s: [sum(b.layer_len(0) for b in bundles[s][:i]) for i in range(len(bundles[s]))] for s in SIDES}
                dec = {k: [] for k in SIDES}
                for rep in range(2 * args.repeats + 1):
                    for side in (SIDES if rep % 2 else SIDES[::-1]):
                        c = time.process_time()
                        ec_batch.decode_into(out, bundles[side], starts[side], q, workers=1)
                        if rep:
                            dec[side].append(time.process_time() - c)
                b = statistics.median(bare[1:])
                for side in SIDES:
                    ct, dt = statistics.median(times[side]), statistics.median(dec[side])
                    print(f"| {len(ids)} | {side} | {stored[side] / 1e6:.3f} | {stored[side] / stored[SIDES[0]]:.4f} | "
                          f"{frames(bundles[side], 'keys')} | {frames(bundles[side], 'values')} | {ct:.3f} | {ct / b:.2f} | "
                          f"{dt:.4f} | {dt / statistics.median(dec[SIDES[0]]):.3f} |", flush=True)
        finally:
            set_bins(SIDES[-1])
            store.close()


if __name__ == "__main__":
    main()
