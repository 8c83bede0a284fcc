"""The CPU decode kernels as they are against an earlier revision's, in one process: the same
cache, less CPU.

    python research/probes/decode_kernels_ab.py [--rev faaf55b] [--tokens 8000] [--repeats 9]

Builds one document of ``--tokens`` tokens (the example corpus, as ``bench/ttft.py`` does),
stores the shipped default (``--budget 0.25``), then decodes the whole version into an fp32
cache with ``ec_batch.decode_into`` (the path a CPU load runs) using the compiled kernels of this
checkout and those of ``--rev`` (``kdnctl/kernels/ec/cpu_jit.py`` read from git and compiled
beside them), on 1 and 2 worker threads, alternating which goes first. Prints medians of
``--repeats``: wall seconds, CPU seconds of the process (all threads) and GB/s of fp32 output;
and whether both caches are equal bit for bit (they must be).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_version import default_bundles  # noqa: E402

from kdnctl.kernels.ec import cpu  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import ec_batch  # noqa: E402


def kernels_of(rev: str, into: Path):
    """``(inflate_frames, decode_blobs, rope_blobs)`` of ``kdnctl/kernels/ec/cpu_jit.py`` at ``rev``."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kdnctl/kernels/ec/cpu_jit.py"],
                         check=True, capture_output=True, text=True).stdout
    src = src.replace("from . import digits", "from kdnctl.kernels.ec import digits")
    src = src.replace("from .errors import", "from kdnctl.kernels.ec.errors import")
    src = src.replace("cache=True", "cache=False")  # (a second copy must not share this one's disk cache)
    path = into / f"cpu_jit_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"cpu_jit_{rev}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.inflate_frames, mod.decode_blobs, mod.rope_blobs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="faaf55b")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bundles = default_bundles(load_model(dtype="float32"), args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        now = cpu.kernels()
        before = kernels_of(args.rev, Path(tmp))
    n_layers, q = bundles[0].n_layers, bundles[0].meta["quant"]
    n_tokens = sum(b.layer_len(0) for b in bundles)
    starts = [sum(b.layer_len(0) for b in bundles[:i]) for i in range(len(bundles))]
    out = tuple(torch.empty(n_layers, q["n_heads"], n_tokens, q["head_dim"]) for _ in range(2))
    gb = 2 * out[0].numel() * 4 / 1e9
    sides = {args.rev: before, "now": now}
    real = cpu.kernels
    caches, rows = {}, []
    try:
        for workers in (1, 2):
            wall = {k: [] for k in sides}
            cpus = {k: [] for k in sides}
            for rep in range(args.repeats + 1):
                order = list(sides) if rep % 2 else list(reversed(sides))
                for name in order:
                    cpu.kernels = lambda k=sides[name]: k
                    t, c = time.perf_counter(), time.process_time()
                    ec_batch.decode_into(out, bundles, starts, q, workers=workers)
                    if rep:  # (the first round compiles)
                        wall[name].append(time.perf_counter() - t)
                        cpus[name].append(time.process_time() - c)
                    caches[name] = [o.clone() for o in out]
            for name in sides:
                w, c = statistics.median(wall[name]), statistics.median(cpus[name])
                rows.append((workers, name, w, c, gb / w))
    finally:
        cpu.kernels = real
    equal = all(torch.equal(a, b) for a, b in zip(caches[args.rev], caches["now"]))
    print(f"{n_tokens} tokens, {len(bundles)} chunks, fp32 cache {gb * 1e3:.0f} MB; medians of {args.repeats}; "
          f"caches equal bit for bit: {equal}\n")
    print("| workers | kernels | wall s | CPU s | GB/s | CPU / before |")
    print("|---:|---|---:|---:|---:|---:|")
    for workers, name, w, c, rate in rows:
        base = next(r[3] for r in rows if r[0] == workers and r[1] == args.rev)
        print(f"| {workers} | {name} | {w:.4f} | {c:.4f} | {rate:.2f} | {c / base:.3f} |")


if __name__ == "__main__":
    main()
