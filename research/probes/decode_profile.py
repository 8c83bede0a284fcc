"""Where one worker's CPU decode of the 0.25 default spends its time: a cProfile of five decodes.

    python research/probes/decode_profile.py TOKENS

One document of the example corpus stored at the default; ``ec_batch.decode_into`` timed on one
and two workers (medians of 5, twice), then profiled over five decodes on one worker (the
compiled kernels, the key basis's matmul and the Python around them, by internal time).
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

from default_version import decode_target, default_bundles, print_profile  # noqa: E402

from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import ec_batch  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    bundles = default_bundles(load_model(dtype="float32"), int(sys.argv[1]))
    q, starts, out = decode_target(bundles)

    def run(w: int) -> float:
        t = time.perf_counter()
        ec_batch.decode_into(out, bundles, starts, q, workers=w)
        return time.perf_counter() - t

    gb = 2 * out[0].numel() * 4 / 1e9
    for w in (1, 2, 1, 2):
        xs = [run(w) for _ in range(5)]
        print(f"workers {w}: median {statistics.median(xs):.4f} s  {gb / statistics.median(xs):.2f} GB/s")
    print_profile(lambda: ec_batch.decode_into(out, bundles, starts, q, workers=1))


if __name__ == "__main__":
    main()
