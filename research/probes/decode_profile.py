"""Where one worker's CPU decode of the 0.25 default spends its time: a cProfile of five decodes.

    python research/probes/decode_profile.py TOKENS

One document of the example corpus stored at the default; ``ec_batch.decode_into`` timed on one
and two workers (medians of 5, twice), then profiled over five decodes on one worker (the
compiled kernels, the key basis's matmul and the Python around them, by internal time).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "research" / "probes"))

from default_version import default_bundles  # noqa: E402

from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import ec_batch  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    bundles = default_bundles(load_model(dtype="float32"), int(sys.argv[1]))
    q = bundles[0].meta["quant"]
    n_layers, h, d = bundles[0].n_layers, q["n_heads"], q["head_dim"]
    lens = [b.layer_len(0) for b in bundles]
    starts = [int(x) for x in np.cumsum([0] + lens[:-1])]
    out = (torch.zeros(n_layers, h, sum(lens), d), torch.zeros(n_layers, h, sum(lens), d))

    def run(w: int) -> float:
        t = time.perf_counter()
        ec_batch.decode_into(out, bundles, starts, q, workers=w)
        return time.perf_counter() - t

    gb = 2 * out[0].numel() * 4 / 1e9
    for w in (1, 2, 1, 2):
        xs = [run(w) for _ in range(5)]
        print(f"workers {w}: median {statistics.median(xs):.4f} s  {gb / statistics.median(xs):.2f} GB/s")
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(5):
        ec_batch.decode_into(out, bundles, starts, q, workers=1)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
    print(s.getvalue())


if __name__ == "__main__":
    main()
