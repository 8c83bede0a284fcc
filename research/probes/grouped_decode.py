"""One worker's CPU decode of the 0.25 default whole and in the layer groups a load behind the
question's forward takes (``kdnctl.engine.overlap.layer_groups``): what the grouping costs.

    python research/probes/grouped_decode.py TOKENS

Medians of 7, twice, alternating; then a cProfile of five grouped decodes by internal time.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "research" / "probes")]

from default_version import decode_target, default_bundles, print_profile  # noqa: E402

from kdnctl.engine.overlap import layer_groups  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import ec_batch  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    bundles = default_bundles(load_model(dtype="float32"), int(sys.argv[1]))
    q, starts, out = decode_target(bundles)

    def run(groups) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            ec_batch.GroupedDecode(out, bundles, starts, q, groups=groups,
                                   on_group=(lambda g: None) if groups else None).run(1)
        return time.perf_counter() - t

    groups = layer_groups(out[0].shape[0])
    for _ in range(2):
        for name, g in (("whole", None), (f"{len(groups)} groups", groups)):
            print(f"{name}: median {statistics.median(run(g) for _ in range(7)):.4f} s")
    print_profile(lambda: run(groups))


if __name__ == "__main__":
    main()
