"""The CPU decode of the 0.25 default with the RoPE tables' cache on and off, in one process.

    python research/probes/cos_sin_cache_ab.py TOKENS

One document of the example corpus stored at the default, then ``ec_batch.decode_into`` on one
and on two workers, alternating, medians of 9: with the cache emptied and set to hold nothing
(each chunk's cos/sin computed at every decode, as when a load's chunks outnumbered the
eight tables the cache held before) and with its shipped limit (every chunk's tables kept).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "research" / "probes"))

from default_version import decode_target, default_bundles  # noqa: E402

from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import ec_batch, transforms  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    lm = load_model(dtype="float32")
    bundles = default_bundles(lm, int(sys.argv[1]))
    q, starts, out = decode_target(bundles)
    shipped = transforms._COS_SIN.limit

    def run(workers: int, limit: int) -> float:
        transforms._COS_SIN.limit = limit
        if limit == 0:
            transforms._COS_SIN.tables.clear()
            transforms._COS_SIN.bytes = 0
        t = time.perf_counter()
        ec_batch.decode_into(out, bundles, starts, q, workers=workers)
        return time.perf_counter() - t

    gb = 2 * out[0].numel() * 4 / 1e9
    for w in (1, 2):
        res = {0: [], shipped: []}
        for _ in range(9):
            for lim in res:
                res[lim].append(run(w, lim))
        a, b = statistics.median(res[0]), statistics.median(res[shipped])
        print(f"{sum(lens)} tokens workers {w}: no cache {a:.4f} s {gb / a:.2f} GB/s | cache {b:.4f} s {gb / b:.2f} GB/s | ratio {b / a:.3f}")


if __name__ == "__main__":
    main()
