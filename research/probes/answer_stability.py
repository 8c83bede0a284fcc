"""How steady are the answer counts? Many versions of the same tasks, per task how many answer.

    python bench/answer_stability.py RUN.json[:LABEL,LABEL] RUN2.json[:LABEL] ...

Each (run, label) is one draw: a version of the same 130 tasks (every label of a run but the
full cache where none are named). The runs' full caches must agree task for task (the same
answers: the same tasks and model). Per kind (needle, multi-fact) it prints each draw's count,
then per task how many draws answer it: tasks every draw answers, none does, and the rest (the
near ties a small change of the stored bits flips). Where versions differ by little (one recipe
in two bundle formats, two step settings), the spread of their counts is what a difference
between two versions must beat; the mixed tasks bound how far any one count can move.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter


def load(spec: str) -> tuple[str, dict, list[str]]:
    path, _, labels = spec.partition(":")
    data = json.load(open(path))
    tasks = {t["id"]: t for t in data["tasks"]}
    names = labels.split(",") if labels else \
        [v for v in (v if isinstance(v, str) else v["label"] for v in data["versions"]) if v != "full"]
    return path, tasks, names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="RESULTS.json or RESULTS.json:LABEL,LABEL")
    ap.add_argument("--kinds", default="needle,multifact")
    args = ap.parse_args()
    runs = [load(s) for s in args.runs]
    ids = set(runs[0][1])
    for _, tasks, _ in runs[1:]:
        ids &= set(tasks)
    ref = runs[0][1]
    for path, tasks, _ in runs[1:]:
        bad = [i for i in ids if tasks[i]["by_version"]["full"].get("answer") != ref[i]["by_version"]["full"].get("answer")]
        if bad:
            raise SystemExit(f"{path}: the full cache answers {len(bad)} tasks in other words (e.g. {bad[0]}): not the same tasks")
    draws = [(f"{path.split('/')[-2]}/{label}", tasks) for path, tasks, labels in runs for label in labels]
    print(f"{len(draws)} draws over the {len(ids)} tasks every run holds\n")
    for kind in args.kinds.split(","):
        kid = sorted(i for i in ids if ref[i]["kind"] == kind)
        full = sum(ref[i]["by_version"]["full"]["correct"] for i in kid)
        counts = {name: sum(t[i]["by_version"][name.split("/", 1)[1]]["correct"] for i in kid) for name, t in draws}
        per_task = {i: sum(t[i]["by_version"][name.split("/", 1)[1]]["correct"] for name, t in draws) for i in kid}
        hist = Counter(per_task.values())
        n = len(draws)
        print(f"## {kind}: {len(kid)} tasks, the full cache answers {full}; 90% of it = {0.9 * full:.1f}")
        print("| draw | right |")
        print("|---|---:|")
        for name, c in counts.items():
            print(f"| {name} | {c} |")
        vals = list(counts.values())
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        print(f"\ncounts: mean {statistics.mean(vals):.1f}, sd {sd:.1f}, min {min(vals)}, max {max(vals)}")
        always, never = hist.get(n, 0), hist.get(0, 0)
        print(f"tasks every draw answers: {always}; none: {never}; mixed: {len(kid) - always - never} "
              f"(right in 1..{n - 1} of {n} draws: {', '.join(f'{k}: {hist[k]}' for k in sorted(hist) if 0 < k < n)})")
        right_full = [i for i in kid if ref[i]["by_version"]["full"]["correct"]]
        mixed_full = sum(0 < per_task[i] < n for i in right_full)
        print(f"of the {len(right_full)} the full cache answers: {sum(per_task[i] == n for i in right_full)} every draw, "
              f"{mixed_full} mixed, {sum(per_task[i] == 0 for i in right_full)} none\n")


if __name__ == "__main__":
    main()
