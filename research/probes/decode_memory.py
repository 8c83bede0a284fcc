"""What fresh memory costs the CPU decode: each worker's scratch kept from one decode to the next,
and the output cache on transparent huge pages, each against the decode as it is.

    python research/probes/decode_memory.py [--sizes 1024,8000] [--repeats 15]

One document of the example corpus stored at the default (``default_bundles``); every decode
writes into a new cache (as a load does). Three sides, alternating, two workers:

* ``now``: ``ec_batch.decode_into`` into ``torch.empty`` caches (each worker's scratch made anew
  per decode, as the product does);
* ``kept scratch``: the workers' scratch objects taken from a pool that outlives the decode;
* ``huge pages``: the caches in an anonymous mapping advised ``MADV_HUGEPAGE`` (this kernel's
  THP mode is ``madvise``).

Prints medians (allocation included) and each side's paired median against ``now``.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from default_version import decode_target, default_bundles  # noqa: E402

from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import ec_batch  # noqa: E402


class PooledScratch:
    """A ``threading.local`` stand-in whose per-thread object comes from ``pool`` (returned by
    :meth:`release`), so a worker thread of the next decode finds its buffers made."""

    pool: list = []
    lock = threading.Lock()

    def __init__(self):
        object.__setattr__(self, "_local", threading.local())
        object.__setattr__(self, "_taken", [])

    def _obj(self):
        local = object.__getattribute__(self, "_local")
        o = getattr(local, "o", None)
        if o is None:
            with self.lock:
                o = self.pool.pop() if self.pool else type("Scratch", (), {})()
            local.o = o
            object.__getattribute__(self, "_taken").append(o)
        return o

    def __getattr__(self, k):
        return getattr(self._obj(), k)

    def __setattr__(self, k, v):
        setattr(self._obj(), k, v)

    def release(self) -> None:
        self.pool.extend(object.__getattribute__(self, "_taken"))


def huge(shape: tuple[int, ...]) -> torch.Tensor:
    n = int(np.prod(shape))
    m = mmap.mmap(-1, n * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    return torch.from_numpy(np.frombuffer(m, np.float32, count=n).reshape(shape))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,8000")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model(dtype="float32")
    plain_init = ec_batch.GroupedDecode.__init__

    def pooled_init(self, *a, **k):
        plain_init(self, *a, **k)
        self.buffers = PooledScratch()

    print(f"two workers, medians of {args.repeats}, a new cache per decode\n")
    print("| tokens | now ms | kept scratch ms | huge pages ms | kept scratch / now (paired) | huge pages / now (paired) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in [int(s) for s in args.sizes.split(",")]:
        bundles = default_bundles(lm, size)
        q, starts, out = decode_target(bundles)
        shape = tuple(out[0].shape)
        del out

        def run(side: str) -> float:
            ec_batch.GroupedDecode.__init__ = pooled_init if side == "kept scratch" else plain_init
            t = time.perf_counter()
            cache = tuple((huge if side == "huge pages" else torch.empty)(shape) for _ in range(2))
            dec = ec_batch.GroupedDecode(cache, bundles, starts, q)
            dec.run(2)
            took = time.perf_counter() - t
            if isinstance(dec.buffers, PooledScratch):
                dec.buffers.release()
            return took

        sides = ("now", "kept scratch", "huge pages")
        res = {s: [] for s in sides}
        for s in sides:
            run(s)
        for rep in range(args.repeats):
            k = rep % len(sides)
            for s in sides[k:] + sides[:k]:
                res[s].append(run(s))
        ec_batch.GroupedDecode.__init__ = plain_init
        med = {s: statistics.median(v) * 1e3 for s, v in res.items()}
        paired = {s: statistics.median(a / b for a, b in zip(res[s], res["now"])) for s in sides[1:]}
        n_tokens = sum(b.layer_len(0) for b in bundles)
        print(f"| {n_tokens} | {med['now']:.1f} | {med['kept scratch']:.1f} | {med['huge pages']:.1f} | "
              f"{paired['kept scratch']:.3f} | {paired['huge pages']:.3f} |")


if __name__ == "__main__":
    main()
