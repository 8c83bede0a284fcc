"""Probe: does the planted answer survive eviction? (the kept set of ``--quant ec --keep``)

For every needle and multi-fact task: ingest its document (unchanged ones are skipped), score it
with each ``--scorers`` entry (``kdnctl.scorers.compute_importance``), take the kept set that
``compress --quant ec --keep K --protect P`` stores (``kdnctl.compress.stages.select.shared_keep``) for each
``--protect`` value, and report whether every token of the answer (and of each distractor: the
other planted facts of a multi-fact task) is in it. An answer that is not kept cannot be read
back, whatever the quantizer does: this separates what selection loses from what precision
loses. With ``--results`` (a ``bench/quality.py`` JSON) the summary also counts the answers kept
among the tasks the full cache answered right. With ``--rank-by SCORER`` each row also says where
the answer's tokens rank among the kept tokens by that scorer (0 = first): the share of the kept
tokens an ec ``--lift SCORER --lift-share S`` must reach to store them finer. No quantization, no
generation: a few seconds a task on the CPU (sentences scorers: tens of seconds)::

    python bench/kept_answers.py --store /tmp/kstore --protect 64,32,16 > kept.log
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def kept(ranges: list[tuple[int, int]], rows: set[int]) -> bool:
    """Some occurrence (a ``[start, end)`` token range) has every token kept."""
    return any(all(i in rows for i in range(a, b)) for a, b in ranges)


def full_correct(path: str | None) -> set[str] | None:
    if not path:
        return None
    data = json.loads(Path(path).read_text())
    return {t["id"] for t in data["tasks"] if t["by_version"].get("full", {}).get("correct")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default="/tmp/kstore")
    ap.add_argument("--kinds", default="needle,multifact")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--keep", type=float, default=0.33)
    ap.add_argument("--protect", default="64", help="comma-separated: the last P tokens always kept")
    ap.add_argument("--scorers", default="sentences-local,sentences")
    ap.add_argument("--results", default=None, help="a bench/quality.py JSON: split by the full cache's answers")
    ap.add_argument("--rank-by", default=None, help="a scorer: where the answer's tokens rank among the kept tokens by it "
                                                    "(the share of kept tokens a --lift by it must reach to lift them)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from bench.lowbit_probe import full_cache
    from kdnctl.compress.stages.score import cat_stats as _cat_stats
    from kdnctl.compress.stages.select import shared_keep
    from kdnctl.evaluation.tasks import ingest_tasks, load_tasks
    from kdnctl.models.load import load_model
    from kdnctl.scorers import compute_importance
    from kdnctl.ingest.prompting import PromptFormat
    from kdnctl.steer.highlight import find_highlight
    from kdnctl.store import Store

    tasks = load_tasks("realtext", kinds=args.kinds.split(","), limit=args.limit)
    lm = load_model()
    store = Store(Path(args.store), create=True)
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    ingest_tasks(lm, store, tasks)
    protects = [int(p) for p in args.protect.split(",")]
    right = full_correct(args.results)
    tally: dict[tuple, list[int]] = {}  # (scorer, protect, kind) -> [answers kept, tasks, kept where full right, full right]
    for task in tasks:
        bundles, keys, values, ids = full_cache(store, task.id)
        L, (H, T, _) = len(keys), keys[0].shape
        header = int(bundles[0].meta.get("header_tokens", 0))
        def ranges(literal: str) -> list[tuple[int, int]]:  # the steering edit's span finder
            return find_highlight(lm.tokenizer, fmt, task.text, ids, ["lit:" + literal]).matches[0].token_ranges
        answer = ranges(task.answer)
        others = [ranges(d) for d in (task.distractors or [])]
        stats = _cat_stats(bundles)
        scored = {}  # scorer -> importance: --rank-by reuses a scorer's model passes
        def importance(name: str) -> torch.Tensor:
            if name not in scored:
                scored[name] = compute_importance(name, stats, lm=lm, keys=keys, values=values, token_ids=ids,
                                                  n_layers=L, n_heads=H)
            return scored[name]
        by = None if args.rank_by is None else importance(args.rank_by).float().mean((0, 1))
        for scorer in args.scorers.split(","):
            imp = importance(scorer)
            for p in protects:
                rows = set(shared_keep(imp, args.keep, header, p).tolist())
                ok = kept(answer, rows)
                t = tally.setdefault((scorer, p, task.kind), [0, 0, 0, 0])
                t[0] += ok
                t[1] += 1
                if right is not None and task.id in right:
                    t[2] += ok
                    t[3] += 1
                row = {"task": task.id, "scorer": scorer, "protect": p, "tokens": T, "answer_kept": ok,
                       "distractors_kept": sum(kept(o, rows) for o in others), "distractors": len(others)}
                if by is not None:  # 0 = the kept token ranked highest by --rank-by; the answer's worst token
                    kept_rows = sorted(rows, key=lambda t: (-float(by[t]), t))
                    place = {t: i / len(kept_rows) for i, t in enumerate(kept_rows)}
                    spans = [[place[i] for i in range(a, b) if i in place] for a, b in answer]
                    row["answer_rank"] = round(min(max(s) if s else 1.0 for s in spans), 4)
                    row["answer_first_rank"] = round(min(s[0] if s else 1.0 for s in spans), 4)
                    row["answer_tokens"] = len(spans[0])
                print(json.dumps(row), flush=True)
    print(f"\nanswers whole in the kept set (keep {args.keep}):")
    print("| scorer | protect | kind | answer kept | where the full cache answered right |")
    print("|---|---:|---|---:|---:|")
    for (scorer, p, kind), (ok, n, okr, nr) in sorted(tally.items()):
        split = f"{okr}/{nr}" if right is not None else "-"
        print(f"| {scorer} | {p} | {kind} | {ok}/{n} | {split} |")


if __name__ == "__main__":
    main()
