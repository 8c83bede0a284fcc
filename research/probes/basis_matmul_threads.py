"""The key basis's batched matmul of the CPU decode (one (chunk, role) job: 90 products
[256, 64] x [64, 64], the codes read transposed), by torch (MKL) and by numpy (OpenBLAS), on one
and two Python threads at once, with numpy's BLAS free or held to one thread.

    python research/probes/basis_matmul_threads.py

Prints milliseconds of wall time per product batch (throughput: the threads' calls over the
elapsed time); preallocated outputs, so no page faults are timed.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import torch
from threadpoolctl import threadpool_limits

B, T, D = 90, 256, 64


def data():
    return torch.randn(B, D, T), torch.randn(B, D, D), torch.randn(B, 1, D), torch.empty(B, T, D)


def run(kind: str, threads: int, n: int = 40) -> float:
    sets = [data() for _ in range(threads)]

    def body(i: int) -> None:
        z, m, mean, y = sets[i]
        if kind == "torch":
            for _ in range(n):
                torch.baddbmm(mean, z.transpose(1, 2), m, out=y)
        else:
            zt, mn, yn = z.numpy().transpose(0, 2, 1), m.numpy(), y.numpy()
            for _ in range(n):
                np.matmul(zt, mn, out=yn)

    body(0)
    workers = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    t = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return (time.perf_counter() - t) / (n * threads) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    for rep in range(2):
        print(f"round {rep}: torch 1 thread {run('torch', 1):.2f} ms, 2 threads {run('torch', 2):.2f}; "
              f"numpy 1 thread {run('numpy', 1):.2f}, 2 threads {run('numpy', 2):.2f}", end="")
        with threadpool_limits(1, user_api="blas"):
            print(f"; numpy, BLAS held to one thread: 1 thread {run('numpy', 1):.2f}, 2 threads {run('numpy', 2):.2f}")


if __name__ == "__main__":
    main()
