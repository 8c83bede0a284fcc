"""What a one-worker grouped CPU decode of the 0.25 default spends outside its compiled kernels
and the key basis's matmul: the Python, numpy and small torch work around them.

    python research/probes/decode_overhead.py [TOKENS]

The kernels (``kdnctl.kernels.ec.cpu``) and ``torch.baddbmm`` are wrapped with timers, and so
are the per-chunk set-up calls (``chunk_params``, which runs the params' inflate kernel, and
``role_tables``). Three rounds of medians of 7 decodes in the layer groups a load behind the
question's forward takes: total, kernels and matmul, the rest, and the set-up.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "research" / "probes")]

import torch  # noqa: E402

from default_version import decode_target, default_bundles  # noqa: E402
from kdnctl.engine.overlap import layer_groups  # noqa: E402
from kdnctl.kernels.ec import cpu  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import ec_batch  # noqa: E402

SPENT = {"kernels": 0.0, "setup": 0.0}


def timed(f, into: str):
    def wrapped(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            SPENT[into] += time.perf_counter() - t
    return wrapped


def main() -> None:
    torch.set_num_threads(1)
    bundles = default_bundles(load_model(dtype="float32"), int(sys.argv[1]) if len(sys.argv) > 1 else 8000)
    q, starts, out = decode_target(bundles)
    kernels = tuple(timed(k, "kernels") for k in cpu.kernels())
    cpu.kernels = lambda: kernels
    torch.baddbmm = timed(torch.baddbmm, "kernels")
    ec_batch.chunk_params = timed(ec_batch.chunk_params, "setup")
    ec_batch.role_tables = timed(ec_batch.role_tables, "setup")
    groups = layer_groups(out[0].shape[0])
    print(f"{len(bundles)} chunks, {len(groups)} layer groups, one worker; seconds per decode, medians of 7")
    for _ in range(3):
        rows = []
        for _ in range(7):
            SPENT.update(kernels=0.0, setup=0.0)
            t = time.perf_counter()
            with torch.inference_mode():
                ec_batch.GroupedDecode(out, bundles, starts, q, groups=groups, on_group=lambda g: None).run(1)
            total = time.perf_counter() - t
            rows.append((total, SPENT["kernels"], total - SPENT["kernels"], SPENT["setup"]))
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        print("total {:.4f}  kernels and matmul {:.4f}  the rest {:.4f}  per-chunk set-up (its inflate included) {:.4f}".format(*med))


if __name__ == "__main__":
    main()
