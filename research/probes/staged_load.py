"""An ec version loaded into a half-precision cache: the compiled batch decoder through float32
host memory (``kdnctl.engine.dequant.ec_staged_into``, what a GPU load now runs too) against the
reference decoder chunk by chunk (``KDNCTL_EC_REFERENCE=1``, what such a load ran before), and a
float32 cache decoded in place, in one process.

    python research/probes/staged_load.py [--tokens 2048,8000] [--repeats 5]

For each size: one document of the example corpus stored at the default (``--budget 0.25``),
then ``context_from_bundles`` from the decoded bundles on SmolLM2 in bfloat16 both ways and in
float32, taking turns within each repetition. Prints medians (seconds, GB/s of the float32
values decoded) and the ratio of the reference to the staged load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_version import default_bundles  # noqa: E402

from kdnctl.engine.hf import context_from_bundles  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="2048,8000")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    lm32 = load_model(dtype="float32")
    lm16 = load_model(dtype="bfloat16")
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), torch threads {torch.get_num_threads()}")
    print("| tokens | bf16 cache, reference s | bf16 cache, staged s | reference / staged | staged GB/s | fp32 cache, in place s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in [int(x) for x in a.tokens.split(",")]:
        bundles = default_bundles(lm32, n)
        q = bundles[0].meta["quant"]
        t = sum(b.layer_len(0) for b in bundles)
        gb = 2 * bundles[0].n_layers * q["n_heads"] * t * q["head_dim"] * 4 / 1e9
        ways = {"reference": (lm16, "1"), "staged": (lm16, ""), "fp32": (lm32, "")}
        times = {k: [] for k in ways}
        for r in range(a.repeats + 1):
            order = list(ways)[r % 3:] + list(ways)[:r % 3]
            for k in order:
                lm, env = ways[k]
                os.environ["KDNCTL_EC_REFERENCE"] = env
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    ctx = context_from_bundles(lm, bundles)
                    took = time.perf_counter() - t0
                del ctx
                if r:
                    times[k].append(took)
        os.environ["KDNCTL_EC_REFERENCE"] = ""
        m = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {t} | {m['reference']:.3f} | {m['staged']:.3f} | {m['reference'] / m['staged']:.1f}x | "
              f"{gb / m['staged']:.2f} | {m['fp32']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
