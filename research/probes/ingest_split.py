"""What each of ingest's statistics adds to a bare prefill, on this machine.

    python research/probes/ingest_split.py TOKENS THREADS REPEATS

One document of the example corpus (as ``bench/ttft.py`` builds it), then, interleaved, every
repetition running each once: a bare forward (``bare_prefill_seconds``), kdnctl's prefill with no
statistics, with the last window's attention, with the window and the per-chunk query energy,
with surprisal alone, and with what ingest computes (surprisal, window, query energy). Prints
each one's best and median seconds and the bare forward's best over its best. Writes nothing.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import ttft  # noqa: E402

from kdnctl.engine.prefill import bare_prefill_seconds, prefill  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402


def main() -> None:
    size, threads, reps = (int(x) for x in sys.argv[1:4])
    torch.set_num_threads(threads)
    lm = load_model(None, dtype="float32")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    ids, _ = fmt.document_ids(lm.tokenizer, ttft.corpus_text(lm.tokenizer, size))
    cases = {
        "bare": lambda: bare_prefill_seconds(lm.model, ids),
        "nostats": lambda: prefill(lm.model, ids, stats=False),
        "window": lambda: prefill(lm.model, ids, stats=("window",)),
        "win+energy": lambda: prefill(lm.model, ids, stats=("window",), energy_chunk=256),
        "surprisal": lambda: prefill(lm.model, ids, stats=("surprisal",)),
        "all-ingest": lambda: prefill(lm.model, ids, stats=("surprisal", "window"), energy_chunk=256),
    }
    for f in cases.values():
        f()
    res = {k: [] for k in cases}
    for _ in range(reps):
        for k, f in cases.items():
            t = time.perf_counter()
            f()
            res[k].append(time.perf_counter() - t)
    b = min(res["bare"])
    for k, v in res.items():
        print(f"{len(ids)} tok thr {threads} {k:12s} min {min(v):.3f} med {statistics.median(v):.3f}  bare/min {b / min(v):.3f}")


if __name__ == "__main__":
    main()
