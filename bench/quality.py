"""Quality vs stored bytes of compress recipes on the real-text task set, all in one run.

    python bench/quality.py [--store DIR] [--tasks realtext] [--split tune|report] [--answer-kinds words]
                            [--limit N] [--threads 1]
                            [--device cpu|cuda] [--dtype float32|float16|bfloat16]
                            [--recipe "--budget 1 --quant int8"]... [--no-default-recipes]
                            [--versions L,...] [--out research/results/quality.json] [--plot PNG] [--plot-kinds PNG]
    python bench/quality.py --merge A.json B.json [--out J] [--plot-kinds PNG]   # shards of one run
    python bench/quality.py --results A.json B.json --plot-kinds PNG [--labels L,...]   # runs of different task sets

1. ingest the task contexts into a bench store (once: unchanged contexts are skipped);
2. run every recipe as a ``kdnctl compress`` argument list (``--recipe`` may repeat; the default
   list is quantization alone and the default pruning method at keep 0.25); the offline
   reconstruction scores are computed once per document and cached on disk in the store;
3. evaluate the full cache and every produced version on every task (``kdnctl eval --tasks``);
4. print the table (accuracy with its count, ratios vs the full cache of the same run, stored
   bytes per token, K/V bytes as a fraction of fp16), the paired table per answer kind (digits /
   words / continuation: answers of the version and of the full cache on the same tasks, lost,
   gained, McNemar p, median per-task NLL ratio) and write the results JSON (+ plot).

``--split tune`` is the half a method is chosen on, ``--split report`` the half it is reported on
(docs/evaluation.md).

Torch runs on ``--threads`` threads (default 1): on a shared 2-core machine two spinning
threads per process cost 5-10x the wall time of one. ``--device``/``--dtype`` (default cpu,
float32: the CPU tables in the docs) choose where and in which dtype the model runs for every
step: ingest, the scorers of compress (passed to ``kdnctl compress --device --dtype``) and the
evaluation; e.g. ``--device cuda --dtype float32`` runs the whole set on a GPU with the numerics
of the CPU tables (float16 is faster and changes the numbers slightly).
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


def run_compress(args: list[str], store: Path, tasks: list[str], device: str | None = None,
                 dtype: str | None = None) -> dict:
    """``kdnctl compress ARGS TASK_IDS --store S --json [--device D --dtype T]`` in this
    process; returns its JSON. The model the scorers need is loaded once per (device, dtype) and
    shared with the caller's (``load_model`` keeps it in memory)."""
    from typer.main import get_command

    from kdnctl.cli.app import app

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        extra = [*(["--device", device] if device else []), *(["--dtype", dtype] if dtype else [])]
        get_command(app).main(["compress", *args, *tasks, "--store", str(store), "--json", *extra],
                              prog_name="kdnctl", standalone_mode=False)
    return json.loads(out.getvalue())


def cache_reconstruct_scores(cache_dir: Path) -> dict:
    """Memoise the offline reconstruction pass on disk, keyed by the model, the token ids and
    the source K/V (deterministic per document); returns counters (hits, misses, seconds)."""
    import torch

    from kdnctl.scorers import reconstruct as scoring

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


def interleave(tasks: list) -> list:
    """Tasks reordered so every prefix holds the kinds in proportion to their counts (each kind
    keeps its own order): a run stopped early evaluated the first tasks of every kind."""
    by_kind: dict[str, list] = {}
    for t in tasks:
        by_kind.setdefault(t.kind, []).append(t)
    keyed = [((i + 0.5) / len(ts), k, t) for k, ts in by_kind.items() for i, t in enumerate(ts)]
    return [t for _, _, t in sorted(keyed, key=lambda x: (x[0], x[1]))]


def deadline_ts(hhmm: str) -> float:
    """Epoch seconds of the next HH:MM on the machine clock (today, or tomorrow if more than 12
    hours passed), or of ``+SECONDS`` from now."""
    import datetime as dt

    if hhmm.startswith("+"):
        return time.time() + float(hhmm[1:])
    h, m = (int(x) for x in hhmm.split(":"))
    now = dt.datetime.now()
    at = now.replace(hour=h, minute=m, second=0, microsecond=0)
    if at <= now - dt.timedelta(hours=12):
        at += dt.timedelta(days=1)
    return at.timestamp()


def write_json(path: Path, result: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


def markdown(result: dict, names: dict[str, str] | None = None) -> str:
    """The results table; ``names`` optionally maps a label to the text shown for it."""
    rows = ["| version | needle acc (n) | multi-fact acc (n) | continuation NLL (n) | needle / full | multi-fact / full "
            "| NLL / full | stored / fp16 | stored bytes/token | K/V payload / fp16 |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    f = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    for v in result["versions"]:
        n, m, c, r = v["needle"], v["multifact"], v["continuation"], v["ratio_vs_full"]
        name = (names or {}).get(v["label"], v["label"])
        rows.append(f"| {name} | {f(n['accuracy'], '.3f')} ({n.get('correct', '-')}/{n['n']}) | "
                    f"{f(m['accuracy'], '.3f')} ({m.get('correct', '-')}/{m['n']}) | {f(c['nll'], '.3f')} ({c['n']}) | "
                    f"{f(r.get('needle'), '.1%')} | {f(r.get('multifact'), '.1%')} | {f(r.get('continuation'), '.1%')} | "
                    f"{f(v.get('stored_fp16_fraction'), '.3f')} | {f(v['bytes_per_token'], ',.0f')} | {f(v['fp16_fraction'], '.3f')} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", default=str(ROOT / ".bench-quality"))
    ap.add_argument("--tasks", default="realtext")
    ap.add_argument("--kinds", default=None, help="comma-separated: needle,multifact,continuation")
    ap.add_argument("--limit", type=int, default=None, help="first N tasks of each kind")
    ap.add_argument("--split", default=None, choices=("tune", "report"),
                    help="only this half of the tasks (tune: choosing a method; report: the numbers it is judged by)")
    ap.add_argument("--answer-kinds", default=None, help="comma-separated: digits,words,continuation")
    ap.add_argument("--recipe", action="append", default=[], help='kdnctl compress arguments, e.g. "--budget 1 --quant int4"')
    ap.add_argument("--recipe-file", default=None, help="more recipes, one kdnctl compress argument list per line "
                    "(# comments)")
    ap.add_argument("--no-default-recipes", action="store_true")
    ap.add_argument("--versions", default="", help="extra labels already in the store to evaluate")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu (default: the CPU tables) or cuda: where the model runs for "
                    "ingest, compress scorers and evaluation")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"),
                    help="model dtype for every step (default float32)")
    ap.add_argument("--out", default=str(ROOT / "research" / "results" / "quality.json"))
    ap.add_argument("--plot", default=None, help="quality-vs-bytes PNG")
    ap.add_argument("--plot-kinds", default=None, metavar="PNG",
                    help="the per-answer-kind plot (accuracy and median answer NLL vs the full cache, by bytes)")
    ap.add_argument("--results", nargs="+", default=None, metavar="JSON",
                    help="no evaluation: draw --plot-kinds from these results files (runs of different task sets)")
    ap.add_argument("--labels", default=None,
                    help="with --results: only these versions (comma-separated); LABEL=SHOWN draws LABEL as SHOWN "
                         "(a variant that has become the default since its run)")
    ap.add_argument("--compress-only", action="store_true", help="ingest and compress, no evaluation")
    ap.add_argument("--interleave", action="store_true",
                    help="evaluate the kinds in proportion (needle, multi-fact, continuation, ...), so a run cut "
                         "short by --deadline holds a balanced subset, the same tasks for every version")
    ap.add_argument("--per-task", action="store_true",
                    help="ingest and compress each task's document right before evaluating it (with --deadline "
                         "a cut-off run spent no time on documents it did not evaluate)")
    ap.add_argument("--shard", default=None, metavar="I/N",
                    help="evaluate only every N-th task from the I-th (0-based), after --interleave: N processes "
                         "with their own --store and --out split one run; --merge joins their results")
    ap.add_argument("--skip-done", nargs="*", default=[], metavar="JSON",
                    help="leave out the tasks already evaluated in these results files (resume a cut-off run)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="no evaluation: join the results files of shards of one run into --out and print the table")
    ap.add_argument("--deadline", default=None,
                    help="HH:MM (machine clock) or +SECONDS: start no new task after it; the results JSON is rewritten "
                         "after every task, so a cut-off run still reports the tasks it finished")
    args = ap.parse_args()
    if args.results:
        if not args.plot_kinds:
            ap.error("--results draws --plot-kinds PNG")
        from kdnctl.evaluation.plot import plot_answer_kinds

        labels = dict(x.split("=", 1) if "=" in x else (x, x) for x in args.labels.split(",")) if args.labels else None
        results = [json.loads(Path(f).read_text()) for f in args.results]
        print(f"plot: {plot_answer_kinds(results, args.plot_kinds, labels)}")
        return
    if args.merge:
        return merge(args)

    import torch

    from kdnctl.errors import KdnError
    from kdnctl.evaluation.paired import answer_kind_markdown, paired_markdown
    from kdnctl.evaluation.tasks import evaluate_tasks, ingest_tasks, load_tasks, missing_documents
    from kdnctl.models.load import load_model
    from kdnctl.store import Store

    torch.set_num_threads(args.threads)
    tasks = load_tasks(args.tasks, kinds=args.kinds.split(",") if args.kinds else None, limit=args.limit,
                       split=args.split, answer_kinds=args.answer_kinds.split(",") if args.answer_kinds else None)
    lm = load_model(device=args.device, dtype=args.dtype)
    store_dir = Path(args.store)
    store = Store(store_dir)
    if args.interleave:
        tasks = interleave(tasks)
    if args.shard:
        i, n = (int(x) for x in args.shard.split("/"))
        if not 0 <= i < n:
            raise SystemExit(f"--shard {args.shard}: I counts from 0 and must be below N (e.g. 0/2 and 1/2)")
        tasks = tasks[i::n]
    # after the shard: a resumed shard keeps its own tasks (skipping first would re-deal them)
    done = {t["id"] for f in args.skip_done for t in json.loads(Path(f).read_text())["tasks"]}
    tasks = [t for t in tasks if t.id not in done]
    recon = cache_reconstruct_scores(store_dir / "bench-cache" / "reconstruct")
    from_file = [l.split("#")[0].strip() for l in Path(args.recipe_file).read_text().splitlines()] if args.recipe_file else []
    recipes = (([] if args.no_default_recipes else default_recipes(compress_options())) + args.recipe
               + [r for r in from_file if r])
    timings = {spec: {"recipe": spec, "seconds": 0.0, "reconstruct_seconds": 0.0, "statuses": set()} for spec in recipes}
    label_of: dict[str, str] = {}  # recipe -> label
    ingest_s = 0.0
    t_start = time.perf_counter()

    prepared: set[str] = set()

    def prepare(batch: list) -> None:
        """Ingest the missing contexts of ``batch`` and compress them with every recipe."""
        nonlocal ingest_s
        batch = [t for t in batch if t.id not in prepared]
        if not batch:
            return
        prepared.update(t.id for t in batch)
        t0 = time.perf_counter()
        todo = missing_documents(store, batch)
        report = ingest_tasks(lm, store, todo) if todo else None
        ingest_s += time.perf_counter() - t0
        if todo:
            print(f"ingest: {len(todo)} contexts, {report.tokens if report else 0} tokens, "
                  f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        for spec in recipes:
            t0, before = time.perf_counter(), recon["seconds"]
            tm = timings[spec]
            try:
                out = run_compress(shlex.split(spec), store_dir, [t.id for t in batch], args.device, args.dtype)
            except KdnError as exc:  # one bad recipe must not cost the rest of the run
                print(f"compress {spec!r} failed: {exc.one_line()}", file=sys.stderr, flush=True)
                tm["error"] = exc.one_line()
                continue
            label_of[spec] = tm["label"] = out["results"][0]["label"]
            tm["seconds"] += time.perf_counter() - t0
            tm["reconstruct_seconds"] += recon["seconds"] - before
            tm["statuses"] |= {r["status"] for r in out["results"]}
            if not args.per_task:
                print(f"compress {spec!r} -> {label_of[spec]}: {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

    prepare(tasks[:1] if args.per_task else tasks)
    labels = [label_of[r] for r in recipes if r in label_of] + [l.strip() for l in args.versions.split(",") if l.strip()]
    if args.compress_only:
        return
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    stop_at = deadline_ts(args.deadline) if args.deadline else None

    def extra() -> dict:
        return {"recipes": [{**t, "seconds": round(t["seconds"], 2), "reconstruct_seconds": round(t["reconstruct_seconds"], 2),
                             "statuses": sorted(t["statuses"])} for t in timings.values()],
                "ingest_seconds": round(ingest_s, 2), "threads": args.threads, "task_file": args.tasks,
                "limit": args.limit, "split": args.split, "answer_kinds": args.answer_kinds, "device": args.device, "dtype": args.dtype, "interleave": args.interleave, "per_task": args.per_task, "deadline": args.deadline,
                "eval_seconds": round(time.perf_counter() - t_start - prep_s(), 2)}

    def prep_s() -> float:
        return ingest_s + sum(t["seconds"] for t in timings.values())

    def checkpoint(partial: dict) -> bool:
        partial.update(extra())
        write_json(out_path, partial)
        if stop_at is not None and time.time() >= stop_at:
            return True
        print(f"{partial['n_tasks']}/{len(tasks)} tasks evaluated", file=sys.stderr, flush=True)
        return False

    before = (lambda task: prepare([task])) if args.per_task else None
    result = evaluate_tasks(lm, store, labels, tasks, max_new_tokens=args.max_new_tokens, on_task=checkpoint,
                            before_task=before)
    result.update(extra())
    write_json(out_path, result)
    eval_s = result["eval_seconds"]
    if result["n_tasks"] < len(tasks):
        print(f"deadline {args.deadline}: stopped after {result['n_tasks']} of {len(tasks)} tasks", file=sys.stderr)
    print(markdown(result))
    print("\n" + paired_markdown(result))
    print("\n" + answer_kind_markdown(result))
    per = {v["label"]: v.get("eval_seconds") for v in result["versions"]}
    print(f"\neval: {eval_s:.1f}s for {len(tasks)} tasks x {len(result['versions'])} versions "
          f"(per version: {', '.join(f'{k} {s:.0f}s' for k, s in per.items() if s is not None)}); results: {out_path}")
    plots(result, args)


def plots(result: dict, args) -> None:
    """The PNGs asked for (``--plot``, ``--plot-kinds``) of one run's ``result``."""
    from kdnctl.evaluation.plot import plot_answer_kinds, plot_quality_vs_bytes

    if args.plot:
        print(f"plot: {plot_quality_vs_bytes(result, args.plot)}")
    if args.plot_kinds:
        print(f"plot: {plot_answer_kinds([result], args.plot_kinds)}")


def merge(args) -> None:
    """``--merge A.json B.json ...``: one table over the union of the shards' tasks (every ratio
    recomputed over the union, tasks in the interleaved order of the task file)."""
    from kdnctl.evaluation.paired import answer_kind_markdown, paired_markdown
    from kdnctl.evaluation.tasks import load_tasks, merge_results

    parts = [json.loads(Path(f).read_text()) for f in args.merge]
    tasks = load_tasks(parts[0].get("task_file") or args.tasks)
    order = [t.id for t in (interleave(tasks) if parts[0].get("interleave") else tasks)]
    result = merge_results(parts, order)
    keep = ("task_file", "device", "dtype", "interleave", "per_task", "threads", "split", "answer_kinds")
    result.update({k: parts[0].get(k) for k in keep})
    result["recipes"] = [r for p in parts[:1] for r in p.get("recipes", [])]
    result["shards"] = [{"file": f, "n_tasks": p["n_tasks"], "deadline": p.get("deadline"),
                         "eval_seconds": p.get("eval_seconds"), "ingest_seconds": p.get("ingest_seconds"),
                         "compress_seconds": round(sum(r["seconds"] for r in p.get("recipes", [])), 2)}
                        for f, p in zip(args.merge, parts)]
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    write_json(out_path, result)
    print(markdown(result))
    print("\n" + paired_markdown(result))
    print("\n" + answer_kind_markdown(result))
    print(f"\nmerged {len(parts)} parts: {result['n_tasks']} tasks; results: {out_path}")
    plots(result, args)


if __name__ == "__main__":
    main()
