"""The torch path of surprisal's vocabulary logsumexp (bf16 where the CPU computes it natively) at
several row and vocabulary tile sizes, on this machine.

    python research/probes/surprisal_tiles.py            the grid below
    python research/probes/surprisal_tiles.py ingest     ingest's prefill, both host tiles

SmolLM2's vocabulary projection's shape (49152 x 576, random bf16 weights: the time depends on
the shapes only), 1,018 and 4,090 rows, two torch threads; each (rows per call, vocabulary rows
per tile) the best of 3 after one untimed call, and its time over the first's (256, 8192).

``ingest``: the default model's prefill with ingest's statistics over 1k, 2k and 4k tokens of the
example corpus, ``SurprisalScorer.HOST_VOCAB_TILE`` 8192 and 2048 alternating, medians of 5, and
the paired median of their ratio.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kdnctl.kernels.vocab import reference  # noqa: E402


def ingest() -> None:
    import statistics

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import ttft

    from kdnctl.engine.prefill import SurprisalScorer, prefill
    from kdnctl.ingest.prompting import PromptFormat
    from kdnctl.models.load import load_model

    torch.set_num_threads(2)
    lm = load_model(None, dtype="float32")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    print("| tokens | tile 8192, s | tile 2048, s | paired median 2048 / 8192 |")
    print("|---:|---:|---:|---:|")
    for size in (1024, 2048, 4096):
        ids, _ = fmt.document_ids(lm.tokenizer, ttft.corpus_text(lm.tokenizer, size))
        res = {8192: [], 2048: []}
        for r in range(6):
            for tile in res:
                SurprisalScorer.HOST_VOCAB_TILE = tile
                t = time.perf_counter()
                prefill(lm.model, ids, stats=("surprisal", "window"), energy_chunk=256)
                if r:
                    res[tile].append(time.perf_counter() - t)
        ratio = statistics.median(b / a for a, b in zip(res[8192], res[2048]))
        print(f"| {len(ids)} | {statistics.median(res[8192]):.3f} | {statistics.median(res[2048]):.3f} | {ratio:.3f} |", flush=True)


def main() -> None:
    if sys.argv[1:] == ["ingest"]:
        ingest()
        return
    torch.set_num_threads(2)
    w = (torch.randn(49152, 576) * 0.05).bfloat16()

    def run(x, rows, tile):
        return torch.cat([reference.vocab_logsumexp(x[s:s + rows], w, None, tile=tile) for s in range(0, x.shape[0], rows)])

    print("| rows | rows per call | vocabulary tile | best of 3, s | / (256, 8192) |")
    print("|---:|---:|---:|---:|---:|")
    for m in (1018, 4090):
        x = torch.randn(m, 576).bfloat16()
        base = None
        for rows, tile in [(256, 8192), (256, 2048), (256, 1024), (256, 4096), (512, 2048), (512, 1024), (128, 2048),
                           (1024, 1024), (1024, 2048)]:
            run(x, rows, tile)
            ts = []
            for _ in range(3):
                t = time.perf_counter()
                run(x, rows, tile)
                ts.append(time.perf_counter() - t)
            b = min(ts)
            base = base or b
            print(f"| {m} | {rows} | {tile} | {b:.4f} | {b / base:.3f} |", flush=True)


if __name__ == "__main__":
    main()
