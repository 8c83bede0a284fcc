"""Kernel micro-benchmarks at the KV sizes of a 7-8B model (32 layers, 8 KV heads, 32 query heads,
head_dim 128, float16 cache), printed as a markdown table.

    python bench/kernel_timings.py [--tokens 4096,16384,32768] [--layers 32] [--out results.json]
    python bench/kernel_timings.py --threads 1     # CPU: reference only, 4k tokens, 4 layers

On a CUDA machine every kernel runs through its dispatcher (-> Triton) and through its torch
reference on the same GPU; the table gives the kernel's time, its achieved bandwidth (bytes it
must read + write / time) as a fraction of the device's measured copy bandwidth (a large
``empty_like(x).copy_(x)``), and the reference's time. Without CUDA only the torch reference
is timed (the Triton interpreter is a correctness tool, far too slow to time) at smaller
default sizes (4k tokens, 4 layers); the table says so.

Sizes: quantization and attention work on one layer (``[8, T, 128]`` keys/values, what a
decode step or a per-layer quantize touches); the KVCrush pieces run on all layers at once, as
kdnctl calls them (scores ``[L, 8, T]``, per-layer head bit-vectors ``[L, T, 1 word]``, gather
of 25% of the tokens of ``[L, 8, T, 128]``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kdnctl.kernels import attention as ka  # noqa: E402
from kdnctl.kernels import kvcrush as kc  # noqa: E402
from kdnctl.kernels import quant as kq  # noqa: E402
from kdnctl.kernels.attention import QuantizedKV  # noqa: E402
from kdnctl.kernels.attention import reference as att_ref  # noqa: E402
from kdnctl.kernels.kvcrush import reference as kc_ref  # noqa: E402
from kdnctl.kernels.quant import reference as q_ref  # noqa: E402

HKV, HQ, D, GROUP = 8, 32, 128, 32
CACHE_DTYPE = torch.float16


def nbytes(*ts) -> int:
    total = 0
    for t in ts:
        if isinstance(t, QuantizedKV):
            total += nbytes(t.q, t.scale, t.zero)
        elif t is not None:
            total += t.numel() * t.element_size()
    return total


def max_diff(a, b) -> float:
    """Largest |a - b| over (tuples of) results: a sanity check that the timed kernel computes
    what the reference does (codes may differ by 1 at exact rounding ties on a GPU)."""
    if isinstance(a, (tuple, list)):
        return max(max_diff(x, y) for x, y in zip(a, b))
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def timer(device: torch.device, repeats: int):
    """ms per call: CUDA events via triton's do_bench on a GPU, wall clock median on CPU."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=10, rep=max(50, 10 * repeats))

    def cpu(fn):
        fn()  # warm-up (allocator, lazy imports)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return cpu


def copy_bandwidth(device: torch.device, bench) -> float:
    """GB/s of a plain device copy: the practical ceiling for a memory-bound kernel."""
    n = (1 << 30) if device.type == "cuda" else (1 << 27)  # 1 GiB on GPU, 128 MiB on CPU
    x = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    if device.type == "cuda":
        ms = bench(lambda: torch.empty_like(x).copy_(x))  # caching allocator: empty_like is free
    else:
        # A fresh 128 MiB CPU buffer is mmap'ed per call, so empty_like would time page faults.
        y = torch.empty_like(x).fill_(0)
        ms = bench(lambda: y.copy_(x))
        del y
    del x
    return 2 * n / (ms * 1e-3) / 1e9


def cases(tokens: int, layers: int, device: torch.device):
    """Yields (kernel, shape, bytes moved, dispatched fn, reference fn). Tensors are built per
    case so large GPU sizes never coexist."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, dtype=CACHE_DTYPE):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    # -- quantization: one layer's keys (per channel) and values (per token) ------------------
    x = randn(HKV, tokens, D)
    for fmt in ("int8", "int4"):
        for role, layout in (("keys", "channel"), ("values", "token")):
            q, s, z = q_ref.quantize(x, fmt, GROUP, layout)  # inputs never depend on a kernel
            shape = f"[{HKV},{tokens},{D}] G{GROUP}"
            yield (f"quantize {fmt} {role}", shape, nbytes(x, q, s, z),
                   lambda fmt=fmt, layout=layout: kq.quantize(x, fmt, GROUP, layout),
                   lambda fmt=fmt, layout=layout: q_ref.quantize(x, fmt, GROUP, layout))
            out = torch.empty(x.shape, dtype=torch.float32, device=device)
            yield (f"dequantize {fmt} {role}", shape + " ->f32", nbytes(q, s, z, out),
                   lambda q=q, s=s, z=z, fmt=fmt, layout=layout: kq.dequantize(q, s, z, fmt, GROUP, layout, x.shape),
                   lambda q=q, s=s, z=z, fmt=fmt, layout=layout: q_ref.dequantize(q, s, z, fmt, GROUP, layout, x.shape))
            del q, s, z, out
    del x

    # -- KVCrush pieces, all layers at once --------------------------------------------------
    scores = randn(layers, HKV, tokens, dtype=torch.float32)
    thr = scores.median(dim=-1).values
    bits = torch.empty(scores.shape, dtype=torch.uint8, device=device)
    yield ("kvcrush binarize", f"[{layers},{HKV},{tokens}]", nbytes(scores, thr, bits),
           lambda: kc.binarize(scores, thr, out=bits), lambda: kc_ref.binarize(scores, thr, out=bits))
    words = kc.pack_bits(bits.permute(0, 2, 1).contiguous())  # [L, T, 1]: 8 head bits per token
    anchor = words[:, 0].clone()
    dist = torch.empty(words.shape[:2], dtype=torch.int32, device=device)
    yield ("kvcrush hamming", f"[{layers},{tokens},{words.shape[-1]}] words", nbytes(words, anchor, dist),
           lambda: kc.hamming(words, anchor, out=dist), lambda: kc_ref.hamming(words, anchor, out=dist))
    del scores, thr, bits, words, anchor, dist
    kv = randn(layers, HKV, tokens, D)
    keep = tokens // 4
    idx = torch.stack([torch.randperm(tokens, generator=g)[:keep].sort().values for _ in range(layers * HKV)])
    idx = idx.view(layers, HKV, keep).to(device)
    out = torch.empty(layers, HKV, keep, D, dtype=kv.dtype, device=device)
    yield ("kvcrush gather 25%", f"[{layers},{HKV},{tokens},{D}] -> {keep}", nbytes(idx) + 2 * nbytes(out),
           lambda: kc.gather_kept(kv, idx, out=out), lambda: kc_ref.gather_kept(kv, idx, out=out))
    del kv, idx, out

    # -- decode attention over one layer, with a steering bias --------------------------------
    k, v = randn(HKV, tokens, D), randn(HKV, tokens, D)
    query = randn(HQ, D)
    bias = torch.where(torch.rand(HQ, tokens, generator=g) < 0.1, -4.6, 0.0).to(device)  # log(0.01)
    out = torch.empty(HQ, D, dtype=torch.float32, device=device)
    operands = {"dense f16": (k, v)}
    for fmt in ("int8", "int4"):
        operands[fmt] = tuple(QuantizedKV(*q_ref.quantize(x, fmt, GROUP, lay), fmt, GROUP, lay, tuple(x.shape))
                              for x, lay in ((k, "channel"), (v, "token")))
    for name, (kk, vv) in operands.items():
        yield (f"decode attention {name} +bias", f"Hq{HQ}/Hkv{HKV} T{tokens} D{D}", nbytes(query, kk, vv, bias, out),
               lambda kk=kk, vv=vv: ka.decode_attention(query, kk, vv, bias, out=out),
               lambda kk=kk, vv=vv: att_ref.decode_attention(query, kk, vv, bias, out=out))


def main() -> None:
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="4096,16384,32768" if cuda else "4096")
    ap.add_argument("--layers", type=int, default=32 if cuda else 4)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, help="CPU only: torch intra-op threads (1 avoids "
                    "thread spin-waits swamping small ops on a shared, oversubscribed machine)")
    ap.add_argument("--out", help="also write the rows as JSON here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if cuda else "cpu")
    bench = timer(device, args.repeats)
    peak = copy_bandwidth(device, bench)
    name = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"device: {name}; copy bandwidth {peak:.1f} GB/s; torch {torch.__version__}")
    if not cuda:
        print("no CUDA: only the torch reference path is timed (the Triton kernels are checked "
              f"for correctness by the interpreter in tests, not timed), at {args.tokens} tokens "
              f"and {args.layers} layers.")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for kernel, shape, moved, fast, slow in cases(tokens, args.layers, device):
            row = dict(kernel=kernel, shape=shape, tokens=tokens, bytes=moved)
            rows.append(row)
            # No kernel had run on GPU hardware when this was written: one that fails to
            # compile or run is reported in its row instead of ending the whole benchmark.
            try:
                timed_ms = row["ref_ms"] = bench(slow)
                if cuda:
                    got = fast()
                    got = tuple(t.clone() for t in got) if isinstance(got, tuple) else got.clone()
                    row["max_diff"] = max_diff(got, slow())  # outputs may share buffers
                    timed_ms = row["triton_ms"] = bench(fast)
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
                continue
            row["gbps"] = moved / (timed_ms * 1e-3) / 1e9
            row["frac_copy"] = row["gbps"] / peak
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    path = "Triton" if cuda else "torch reference (CPU)"
    print(f"\n| kernel | shape | MB moved | {path} ms | GB/s | % of copy BW |"
          + (" torch ref ms | speed-up | max diff vs ref |" if cuda else ""))
    print("|---|---|---:|---:|---:|---:|" + ("---:|---:|---:|" if cuda else ""))
    for r in rows:
        if "error" in r:
            print(f"| {r['kernel']} | {r['shape']} | {r['bytes'] / 1e6:.1f} | failed: {r['error']} |")
            continue
        ms = r.get("triton_ms", r["ref_ms"])
        line = (f"| {r['kernel']} | {r['shape']} | {r['bytes'] / 1e6:.1f} | {ms:.3g} | {r['gbps']:.3g} "
                f"| {100 * r['frac_copy']:.0f}% |")
        if cuda:
            line += f" {r['ref_ms']:.3g} | {r['ref_ms'] / ms:.1f}x | {r['max_diff']:.2g} |"
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=name, copy_gbps=peak, rows=rows), indent=1))


if __name__ == "__main__":
    main()
