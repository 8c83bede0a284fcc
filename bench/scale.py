"""Ingest throughput: one process vs a local Ray with 1 and 2 workers, same corpus, one run.

    python bench/scale.py [--docs 8] [--doc-tokens 512] [--workers 1,2] [--model PATH] [--json OUT]

The corpus is the example documents cut into ``--docs`` pieces of ``--doc-tokens`` tokens. Each
configuration ingests it into a fresh store. ``steady tok/s`` counts from the first document
handed out to the last commit (workers already hold the model); ``job tok/s`` also counts
starting the workers (each loads the model) and, for the first Ray run, starting Ray itself.
The single process runs with torch's default thread count and with one thread (what each CPU
Ray worker gets: Ray sets OMP_NUM_THREADS=1), and once more at the end so drift on a shared
machine shows; Ray workers get one CPU slot each, or one GPU where the cluster has GPUs. The catalogs of all runs are checked
equal (SOURCE_DATE_EPOCH is fixed), so every row did the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kdnctl.ingest.corpus import read_corpus  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.store import Store  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "corpus"


def make_corpus(tokenizer, out: Path, n_docs: int, doc_tokens: int) -> None:
    ids = tokenizer("\n\n".join(p.read_text() for p in sorted(EXAMPLES.iterdir())), add_special_tokens=False).input_ids
    while len(ids) < n_docs * doc_tokens:
        ids = ids + ids
    for i in range(n_docs):
        (out / f"doc-{i:03d}.txt").write_text(tokenizer.decode(ids[i * doc_tokens:(i + 1) * doc_tokens]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--address", default="local", help="a Ray cluster address, or local")
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1700000000")
    import ray
    import torch

    from kdnctl.distributed.ingest import ingest_on_ray

    lm = load_model(args.model)
    opts = IngestOptions()
    rows, dumps = [], []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus"
        corpus.mkdir()
        make_corpus(lm.tokenizer, corpus, args.docs, args.doc_tokens)
        docs, _ = read_corpus([corpus])
        threads = torch.get_num_threads()

        def single(name: str, n_threads: int) -> None:
            torch.set_num_threads(n_threads)
            with Store(Path(tmp) / name) as st:
                t0 = time.perf_counter()
                rep = ingest_documents(st, lm, docs, opts)
                wall = time.perf_counter() - t0
                dumps.append(st.catalog_dump())
            torch.set_num_threads(threads)
            rows.append({"config": f"1 process, {n_threads} torch thread(s){' (again, last)' if 'again' in name else ''}",
                         "tokens": rep.tokens, "steady_tok_s": rep.tokens / rep.seconds, "job_tok_s": rep.tokens / wall,
                         "setup_s": 0.0})

        single("single", threads)
        if threads > 1:
            single("single-1t", 1)  # what each CPU Ray worker gets
        t_ray = time.perf_counter()
        if args.address == "local":
            ray.init(num_cpus=max(int(w) for w in args.workers.split(",")), include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=args.address, include_dashboard=False, log_to_driver=False)
        ray_start = time.perf_counter() - t_ray
        devices = []
        first = int(args.workers.split(",")[0])
        for n in [int(w) for w in args.workers.split(",")]:
            with Store(Path(tmp) / f"ray{n}") as st:
                t0 = time.perf_counter()
                rep = ingest_on_ray(st, docs, opts, address=args.address, workers=n, model=args.model,
                                    on_start=lambda infos: devices.append(infos[0].get("device")))
                wall = time.perf_counter() - t0 + (ray_start if n == first else 0.0)
                dumps.append(st.catalog_dump())
            rows.append({"config": f"Ray, {n} worker(s) on {devices[-1]}", "tokens": rep.tokens,
                         "steady_tok_s": rep.tokens / rep.seconds, "job_tok_s": rep.tokens / wall,
                         "setup_s": wall - rep.seconds})
        ray.shutdown()
        single("single-again", threads)  # the same baseline at the end: how much the machine drifted
    same = all(d == dumps[0] for d in dumps)
    base = rows[0]["steady_tok_s"]
    print(f"{args.docs} documents x {args.doc_tokens} tokens; catalogs equal across runs: {same}; "
          f"Ray start {ray_start:.1f}s; {os.cpu_count()} CPU cores\n")
    print("| configuration | tokens | steady tok/s | vs 1 process | job tok/s (incl. start) | start s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['config']} | {r['tokens']} | {r['steady_tok_s']:.0f} | {r['steady_tok_s'] / base:.2f}x | "
              f"{r['job_tok_s']:.0f} | {r['setup_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "catalogs_equal": same, "ray_start_s": ray_start,
                                               "docs": args.docs, "doc_tokens": args.doc_tokens}, indent=2))
    if not same:
        sys.exit("catalogs differ between runs")


if __name__ == "__main__":
    main()
