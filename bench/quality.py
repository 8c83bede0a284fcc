"""Quality vs stored bytes of compress recipes on the real-text task set, all in one run.

    python bench/quality.py [--store DIR] [--tasks realtext] [--limit N] [--threads 1]
                            [--recipe "--budget 1 --quant int8"]... [--no-default-recipes]
                            [--versions L,...] [--out bench/results/quality.json] [--plot PNG]

1. ingest the task contexts into a bench store (once: unchanged contexts are skipped);
2. run every recipe as a ``kdnctl compress`` argument list (``--recipe`` may repeat; the default
   list is quantization alone and the default pruning method at keep 0.25); the offline
   reconstruction scores are computed once per document and cached on disk in the store;
3. evaluate the full cache and every produced version on every task (``kdnctl eval --tasks``);
4. print the table (accuracy with its count, ratios vs the full cache of the same run, stored
   bytes per token, K/V bytes as a fraction of fp16) and write the results JSON (+ plot).

Torch runs on ``--threads`` threads (default 1): on a shared 2-core machine two spinning
threads per process cost 5-10x the wall time of one.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def default_recipes(compress_options: set[str]) -> list[str]:
    """Quantization alone and pruning alone at a quarter of the tokens, in whichever spelling
    the current ``kdnctl compress`` has (``--keep`` once the size budget took ``--budget``)."""
    keep = "--keep 0.25" if "--keep" in compress_options else "--budget 0.25"
    return ["--budget 1 --quant int8", "--budget 1 --quant int4", f"--method kvcrush {keep}"]


def compress_options() -> set[str]:
    from typer.main import get_command

    from kdnctl.cli.app import app

    cmd = get_command(app).commands["compress"]
    return {o for p in cmd.params for o in getattr(p, "opts", [])}


def run_compress(args: list[str], store: Path, tasks: list[str]) -> dict:
    """``kdnctl compress ARGS TASK_IDS --store S --json`` in this process; returns its JSON."""
    from typer.main import get_command

    from kdnctl.cli.app import app

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        get_command(app).main(["compress", *args, *tasks, "--store", str(store), "--json"],
                              prog_name="kdnctl", standalone_mode=False)
    return json.loads(out.getvalue())


def cache_reconstruct_scores(cache_dir: Path) -> dict:
    """Memoise the offline reconstruction pass on disk, keyed by the model, the token ids and
    the source K/V (deterministic per document); returns counters (hits, misses, seconds)."""
    import torch

    from kdnctl import scoring

    real = scoring.reconstruct_scores
    stats = {"hits": 0, "misses": 0, "seconds": 0.0}
    cache_dir.mkdir(parents=True, exist_ok=True)

    def cached(lm, keys, values, token_ids, **kw):
        h = hashlib.sha256(lm.fingerprint.encode())
        h.update(json.dumps([int(t) for t in token_ids]).encode())
        h.update(json.dumps(sorted(kw.items()), default=str).encode())
        for t in (keys[0], values[-1]):
            h.update(t.float().contiguous().numpy().tobytes()[:1 << 20])
        path = cache_dir / f"{h.hexdigest()[:32]}.pt"
        if path.is_file():
            stats["hits"] += 1
            return torch.load(path)
        t0 = time.perf_counter()
        out = real(lm, keys, values, token_ids, **kw)
        stats["seconds"] += time.perf_counter() - t0
        stats["misses"] += 1
        tmp = path.with_suffix(".tmp")
        torch.save(out, tmp)
        tmp.replace(path)
        return out

    scoring.reconstruct_scores = cached
    return stats


def markdown(result: dict) -> str:
    rows = ["| version | needle acc (n) | multi-fact acc (n) | continuation NLL (n) | needle / full | multi-fact / full | NLL / full | stored bytes/token | K/V fraction of fp16 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for v in result["versions"]:
        n, m, c, r = v["needle"], v["multifact"], v["continuation"], v["ratio_vs_full"]
        rows.append(f"| {v['label']} | {f(n['accuracy'], '.3f')} ({n['n']}) | {f(m['accuracy'], '.3f')} ({m['n']}) | "
                    f"{f(c['nll'], '.3f')} ({c['n']}) | {f(r.get('needle'), '.1%')} | {f(r.get('multifact'), '.1%')} | "
                    f"{f(r.get('continuation'), '.1%')} | {f(v['bytes_per_token'], ',.0f')} | {f(v['fp16_fraction'], '.3f')} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(ROOT / ".bench-quality"))
    ap.add_argument("--tasks", default="realtext")
    ap.add_argument("--kinds", default=None, help="comma-separated: needle,multifact,continuation")
    ap.add_argument("--limit", type=int, default=None, help="first N tasks of each kind")
    ap.add_argument("--recipe", action="append", default=[], help='kdnctl compress arguments, e.g. "--budget 1 --quant int4"')
    ap.add_argument("--no-default-recipes", action="store_true")
    ap.add_argument("--versions", default="", help="extra labels already in the store to evaluate")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quality.json"))
    ap.add_argument("--plot", default=None, help="quality-vs-bytes PNG")
    args = ap.parse_args()

    import torch

    from kdnctl.errors import KdnError
    from kdnctl.evaluation.tasks import evaluate_tasks, ingest_tasks, load_tasks, missing_documents
    from kdnctl.model import load_model
    from kdnctl.store import Store

    torch.set_num_threads(args.threads)
    tasks = load_tasks(args.tasks, kinds=args.kinds.split(",") if args.kinds else None, limit=args.limit)
    ids = [t.id for t in tasks]
    lm = load_model()
    store_dir = Path(args.store)
    store = Store(store_dir)
    t0 = time.perf_counter()
    todo = missing_documents(store, tasks)
    report = ingest_tasks(lm, store, todo) if todo else None
    ingest_s = time.perf_counter() - t0
    print(f"ingest: {len(todo)} contexts, {report.tokens if report else 0} tokens, {ingest_s:.1f}s", file=sys.stderr)

    recon = cache_reconstruct_scores(store_dir / "bench-cache" / "reconstruct")
    recipes = ([] if args.no_default_recipes else default_recipes(compress_options())) + args.recipe
    labels, timings = [], []
    for spec in recipes:
        t0 = time.perf_counter()
        before = recon["seconds"]
        try:
            out = run_compress(shlex.split(spec), store_dir, ids)
        except KdnError as exc:  # one bad recipe must not cost the rest of the run
            print(f"compress {spec!r} failed: {exc.one_line()}", file=sys.stderr, flush=True)
            timings.append({"recipe": spec, "error": exc.one_line()})
            continue
        label = out["results"][0]["label"]
        labels.append(label)
        elapsed = time.perf_counter() - t0
        timings.append({"recipe": spec, "label": label, "seconds": round(elapsed, 2),
                        "reconstruct_seconds": round(recon["seconds"] - before, 2),
                        "statuses": sorted({r["status"] for r in out["results"]})})
        print(f"compress {spec!r} -> {label}: {elapsed:.1f}s", file=sys.stderr, flush=True)
    labels += [l.strip() for l in args.versions.split(",") if l.strip()]

    t0 = time.perf_counter()
    result = evaluate_tasks(lm, store, labels, tasks, max_new_tokens=args.max_new_tokens)
    eval_s = time.perf_counter() - t0
    result.update({"recipes": timings, "ingest_seconds": round(ingest_s, 2), "eval_seconds": round(eval_s, 2),
                   "threads": args.threads, "task_file": args.tasks, "limit": args.limit})
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(out_path)
    print(markdown(result))
    per = {v["label"]: v.get("eval_seconds") for v in result["versions"]}
    print(f"\neval: {eval_s:.1f}s for {len(tasks)} tasks x {len(result['versions'])} versions "
          f"(per version: {', '.join(f'{k} {s:.0f}s' for k, s in per.items() if s is not None)}); results: {out_path}")
    if args.plot:
        from kdnctl.evaluation.plot import plot_quality_vs_bytes

        print(f"plot: {plot_quality_vs_bytes(result, args.plot)}")


if __name__ == "__main__":
    main()
