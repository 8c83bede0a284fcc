"""Where the load time of an entropy-coded (``ec``) version goes, on the host.

    python bench/ec_decode.py [--tokens 2048] [--repeats 5] [--threads 1,2]

Builds one document of ``--tokens`` tokens (the example corpus, as ``bench/ttft.py`` does),
stores the shipped default (``kdnctl compress`` with no options: ``--budget 0.25``, ``ec``) and
times, as medians of ``--repeats`` in one run:

* inflate: the time spent inside the frame decoder (``entropy.decompress_frame``) during a host
  decode of every chunk, with zlib's inflate and with ISA-L's (``deflate.INFLATER``, the
  default where python-isal is installed), which decode the same streams to the same bytes;
* host decode: every layer and role of every chunk to integers, step, mean and levels
  (``EntropyQuantizer.host_decode``: inflate + unpack + reorder), what a GPU load does on the
  host before shipping the integers; with ``--threads`` worker threads over the chunks;
* batch decode: what a CPU load runs (``kdnctl.quant.ec_batch.decode_into``: one compiled pass
  per chunk and role, inflate to RoPE, on 1 and 2 threads), in GB/s of the fp32 cache it fills;
  the reference decoder (``host decode`` + dequantize, layer by layer) beside it; also per CPU
  second of the process (all threads), which a machine shared with other jobs moves far less;
* compress: seconds per 1,000 tokens of the default's compress, beside ingest's;
* on a GPU, the device decoder (``kdnctl.quant.ec_device``: the host inflates, one kernel per role
  writes the cache) into a float32 and a bfloat16 cache, beside the staged path it replaces (the
  batch decoder into page-locked float32 host memory, copied); GB/s of the fp32 cache's bytes;
* load: ``load_document`` of the version onto ``--device`` (the batch decoder on the host's cores
  into the cache on a CPU, the device decoder on a GPU), the
  same through the reference decoder (``KDNCTL_EC_REFERENCE=1``: host decode layer by layer, the
  integers dequantized on the device), of the same budget with keys in channels
  (``--key-basis none``), and of ``full`` for scale.

The bytes and time per chunk say what a faster decoder would have to beat; the thread column
says how far Python threads get while part of the work holds the GIL.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ttft import corpus_text  # noqa: E402

from kdnctl.format.bundle import decode_bundle  # noqa: E402

from kdnctl.format.names import tensor_name
from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.engine.hf import load_document  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import entropy  # noqa: E402
from kdnctl.quant.coders import deflate  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def host_decode_all(bundles, n_layers: int, threads: int) -> None:
    def one(b):
        q = b.meta["quant"]
        for i in range(n_layers):
            for role in entropy.ROLES:
                entropy.EntropyQuantizer.host_decode(b.tensors, tensor_name(i, role), q)

    if threads <= 1:
        for b in bundles:
            one(b)
        return
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, bundles))


def inflate_seconds(bundles, n_layers: int) -> float:
    """Seconds inside ``decompress_frame`` during one single-threaded host decode (the inflate
    of ``deflate.INFLATER``)."""
    spent = [0.0]
    real = entropy.decompress_frame

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    entropy.decompress_frame = timed
    try:
        host_decode_all(bundles, n_layers, 1)
    finally:
        entropy.decompress_frame = real
    return spent[0]


def med(fn, n: int) -> float:
    return med_cpu(fn, n)[0]


def med_cpu(fn, n: int) -> tuple[float, float]:
    """Medians of (wall seconds, this process's CPU seconds over all its threads): on a machine
    shared with other jobs the wall time swings with whatever else runs; the CPU time is what
    the decode itself costs."""
    wall, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return statistics.median(wall), statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default="1,2", help="worker threads for the host decode, comma-separated")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="where the loaded cache goes: cpu or cuda (model fp32)")
    args = ap.parse_args()
    torch.set_num_threads(args.torch_threads)
    lm = load_model(device=args.device, dtype="float32")
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        text = corpus_text(lm.tokenizer, args.tokens)
        doc = Document("bench.txt", text, "bench", hashlib.sha256(text.encode()).hexdigest())
        t = time.perf_counter()
        ingest_documents(store, lm, [doc], IngestOptions())
        ingest_s = time.perf_counter() - t
        with store.writer():
            t = time.perf_counter()
            res = compress_document(store, doc.doc_id, CompressRecipe(), lm=lm, label="default")
            compress_s = time.perf_counter() - t
            # the same budget with keys in channels (no key basis: one matmul per layer less at load)
            compress_document(store, doc.doc_id, CompressRecipe(key_basis="none"), lm=lm, label="channels")
        version = store.get_version(doc.doc_id, "default")
        bundles = [decode_bundle(store.read_object(c.object)) for c in version.chunks]
        n_layers = bundles[0].n_layers
        n_tokens = sum(b.n_tokens for b in bundles)
        stored = sum(c.nbytes for c in version.chunks)
        inflaters = ["zlib", "isal"] if deflate.inflate_module("isal") is not deflate.inflate_module("zlib") else ["zlib"]
        default_inflater = deflate.INFLATER
        inflate, host = {}, {}
        for name in inflaters:
            deflate.INFLATER = name
            inflate[name] = statistics.median(inflate_seconds(bundles, n_layers) for _ in range(args.repeats))
            host[name] = med(lambda: host_decode_all(bundles, n_layers, 1), args.repeats)
        deflate.INFLATER = default_inflater
        rows = [(th, med(lambda: host_decode_all(bundles, n_layers, th), args.repeats))
                for th in (int(x) for x in args.threads.split(","))]
        from kdnctl.quant import ec_batch

        q = bundles[0].meta["quant"]
        out = tuple(torch.empty(n_layers, q["n_heads"], n_tokens, q["head_dim"]) for _ in range(2))
        starts = [sum(b.layer_len(0) for b in bundles[:i]) for i in range(len(bundles))]
        fp32_gb = 2 * out[0].numel() * 4 / 1e9
        batch = {}
        if ec_batch.eligible(bundles, n_layers, q, out):
            for th in (1, 2):
                ec_batch.decode_into(out, bundles, starts, q, workers=th)  # (first call: numba's cache)
                batch[th] = med_cpu(lambda: ec_batch.decode_into(out, bundles, starts, q, workers=th), args.repeats)

        device_rows = {}
        if lm.device.type == "cuda":  # the device decoder against the staged path, same chunks
            from kdnctl.engine.dequant import ec_staged_into
            from kdnctl.quant import ec_device

            offsets = [[s_] * n_layers for s_ in starts]
            lens = [[b.layer_len(0)] * n_layers for b in bundles]

            def synced(fn):
                def run():
                    fn()
                    torch.cuda.synchronize(lm.device)
                return run

            for dtype in (torch.float32, torch.bfloat16):
                dev_out = tuple(torch.empty(n_layers, q["n_heads"], n_tokens, q["head_dim"], dtype=dtype, device=lm.device)
                                for _ in range(2))
                if ec_device.eligible(bundles, n_layers, q, dev_out):
                    fn = synced(lambda: ec_device.decode_into(dev_out, bundles, starts, q))
                    fn()  # (first call: Triton's compile)
                    device_rows[f"device decoder (kdnctl.quant.ec_device), {dtype} cache"] = med_cpu(fn, args.repeats)
                fn = synced(lambda: ec_staged_into(bundles, n_layers, dev_out, offsets, lens))
                fn()
                device_rows[f"staged (batch decoder on the host, copied), {dtype} cache"] = med_cpu(fn, args.repeats)

        def reference_decode():
            for b in bundles:
                for role, o in zip(entropy.ROLES, out):
                    entropy.EntropyQuantizer.dequantize_into(o[:, :, :b.layer_len(0)], b.tensors,
                                                             [tensor_name(i, role) for i in range(n_layers)], b.meta["quant"])

        ref = med(reference_decode, args.repeats)

        def load(label):
            load_document(lm, store, doc.doc_id, label, workers=1)
            if lm.device.type == "cuda":
                torch.cuda.synchronize(lm.device)

        load_ec = med(lambda: load("default"), args.repeats)

        def load_by_reference():
            before = os.environ.get("KDNCTL_EC_REFERENCE")
            os.environ["KDNCTL_EC_REFERENCE"] = "1"
            try:
                load("default")
            finally:
                if before is None:
                    del os.environ["KDNCTL_EC_REFERENCE"]
                else:
                    os.environ["KDNCTL_EC_REFERENCE"] = before

        load_ref = med(load_by_reference, args.repeats)
        load_channels = med(lambda: load("channels"), args.repeats)
        load_full = med(lambda: load("full"), args.repeats)
        store.close()
    n_chunks = len(bundles)
    base = host["zlib"]
    print(f"{n_tokens} tokens, {n_chunks} chunks, default version {stored / 1e6:.1f} MB "
          f"({res.fraction_of_fp16:.3f} of fp16); loads onto {lm.device}; torch threads {args.torch_threads}; "
          f"medians of {args.repeats}; the loader inflates with {deflate.inflate_module(default_inflater).__name__}\n")
    print("| step | seconds | ms per chunk | / host decode with zlib (1 thread) |")
    print("|---|---:|---:|---:|")
    for name in inflaters:
        print(f"| inflate, {name} (inside decompress_frame) | {inflate[name]:.4f} | "
              f"{1e3 * inflate[name] / n_chunks:.2f} | {inflate[name] / base:.0%} |")
    for name in inflaters:
        print(f"| host decode, {name}, 1 thread | {host[name]:.4f} | {1e3 * host[name] / n_chunks:.2f} | "
              f"{host[name] / base:.0%} |")
    for th, s in rows:
        print(f"| host decode, the loader's inflate, {th} thread(s) | {s:.4f} | {1e3 * s / n_chunks:.2f} | {s / base:.0%} |")
    where = lm.device.type.upper()
    print(f"| {where} load of the default (load_document, 1 worker) | {load_ec:.4f} | {1e3 * load_ec / n_chunks:.2f} | - |")
    print(f"| {where} load of the default, reference decoder (KDNCTL_EC_REFERENCE=1) | {load_ref:.4f} | "
          f"{1e3 * load_ref / n_chunks:.2f} | the default's load is {load_ec / load_ref:.2f}x this |")
    print(f"| {where} load of the same budget, keys in channels (--key-basis none) | {load_channels:.4f} | "
          f"{1e3 * load_channels / n_chunks:.2f} | the default's load is {load_ec / load_channels:.2f}x this |")
    print(f"| {where} load of full (fp32, for scale) | {load_full:.4f} | {1e3 * load_full / n_chunks:.2f} | - |")
    print(f"\nDecode into an fp32 cache ({fp32_gb * 1e3:.0f} MB), GB/s of output:\n")
    print("| decoder | seconds | GB/s | / reference | CPU seconds (all threads) | GB/s per CPU second |\n"
          "|---|---:|---:|---:|---:|---:|")
    print(f"| reference (layer by layer: host decode, dequantize, basis, RoPE) | {ref:.4f} | {fp32_gb / ref:.2f} | 1.00x | - | - |")
    for th, (s, c) in batch.items():
        print(f"| batch (kdnctl.quant.ec_batch), {th} thread(s) | {s:.4f} | {fp32_gb / s:.2f} | {ref / s:.1f}x faster | "
              f"{c:.4f} | {fp32_gb / c:.2f} |")
    for name, (s, c) in device_rows.items():
        print(f"| {name} | {s:.4f} | {fp32_gb / s:.2f} | {ref / s:.1f}x faster | {c:.4f} | {fp32_gb / c:.2f} |")
    print(f"\nCompress vs ingest, seconds per 1,000 tokens: ingest {1e3 * ingest_s / n_tokens:.2f}, "
          f"default compress {1e3 * compress_s / n_tokens:.2f} ({compress_s / ingest_s:.2f}x ingest)")


if __name__ == "__main__":
    main()
