"""An ec version loaded into a half-precision cache by the compiled batch decoder through float32
host memory (``kdnctl.engine.dequant.ec_staged_into``, what a GPU load runs too) against the
reference decoder chunk by chunk (``KDNCTL_EC_REFERENCE=1``, what such loads ran before), and a
float32 cache decoded in place, in one process.

    python research/probes/staged_load.py [--tokens 2048,8000] [--repeats 5]

For each size: one document of the example corpus stored at the default (``--budget 0.25``),
then ``context_from_bundles`` from the decoded bundles on SmolLM2 in bfloat16, float16 (each
both ways) and float32, taking turns within each repetition. Prints medians (seconds, GB/s of
the float32 values decoded) and the ratios of the reference to the staged batch decode.
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
    lmh = load_model(dtype="float16")
    print(f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), torch threads {torch.get_num_threads()}")
    print("| tokens | bf16, reference s | bf16, staged s | reference / staged | fp16, reference s | fp16, staged s | "
          "reference / staged | fp32, in place s | bf16 staged GB/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in [int(x) for x in a.tokens.split(",")]:
        bundles = default_bundles(lm32, n)
        q = bundles[0].meta["quant"]
        t = sum(b.layer_len(0) for b in bundles)
        gb = 2 * bundles[0].n_layers * q["n_heads"] * t * q["head_dim"] * 4 / 1e9
        ways = {"bf16 ref": (lm16, "1"), "bf16": (lm16, ""), "fp16 ref": (lmh, "1"), "fp16": (lmh, ""), "fp32": (lm32, "")}
        times = {k: [] for k in ways}
        for r in range(a.repeats + 1):
            order = list(ways)[r % len(ways):] + list(ways)[:r % len(ways)]
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
        print(f"| {t} | {m['bf16 ref']:.3f} | {m['bf16']:.3f} | {m['bf16 ref'] / m['bf16']:.1f}x | {m['fp16 ref']:.3f} | "
              f"{m['fp16']:.3f} | {m['fp16 ref'] / m['fp16']:.1f}x | {m['fp32']:.3f} | {gb / m['bf16']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
