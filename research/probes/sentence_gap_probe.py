"""Probe: which second sentence rank keeps the planted answers at 0.083's kept third?

``dump`` writes, per needle or multi-fact task already ingested in a store, each sentence's mean
surprisal given the whole document and given only its preceding ``--windows`` tokens
(``kdnctl.scorers.sentences.local_sentence_surprisal``; window 0: the sentence alone), the token
surprisals, and the token ranges of the answer and of the distractors. ``analyze`` reads such
dumps and, for each weight a in ``--weights``, takes the kept set ``compress --quant ec --keep K
--protect P`` would store (``kdnctl.compress.stages.select.shared_keep``) with every sentence scored by the
better of two ranks, its whole-document surprisal and ``local + a x (local - whole)`` (a = 0 is
``sentences-local``, ``GAP_WEIGHT`` is ``sentences-gap``), and reports whether every token of the
answer is kept, and the mean rank at which the kept set is cut. No quantization, no generation::

    python bench/sentence_gap_probe.py dump --store S --kinds multifact --tasks 019,022 --out mf.jsonl
    python bench/sentence_gap_probe.py analyze mf.jsonl needle.jsonl --results R/quality.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def dump(args) -> None:
    from bench.lowbit_probe import full_cache
    from kdnctl.compress.stages.score import cat_stats as _cat_stats
    from kdnctl.evaluation.tasks import load_tasks
    from kdnctl.models.load import load_model
    from kdnctl.ingest.prompting import PromptFormat
    from kdnctl.scorers.sentences import local_sentence_surprisal, sentence_bounds, token_texts
    from kdnctl.steer.highlight import find_highlight
    from kdnctl.store import Store

    lm = load_model()
    store = Store(Path(args.store))
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    want = set(args.tasks.split(",")) if args.tasks else None
    tasks = [t for t in load_tasks("realtext", kinds=args.kinds.split(","), limit=args.limit)
             if want is None or t.id[-3:] in want]
    with open(args.out, "w") as out:
        for task in tasks:
            bundles, _, _, ids = full_cache(store, task.id)
            s = _cat_stats(bundles)["surprisal"].float().reshape(-1)
            texts = token_texts(lm.tokenizer, ids)
            bounds = sentence_bounds(texts)
            rec = {"id": task.id, "T": len(ids), "header": int(bundles[0].meta.get("header_tokens", 0)),
                   "bounds": bounds, "tok": s.tolist()}
            for w in args.windows:
                rec[f"local{w}"] = local_sentence_surprisal(lm, ids, bounds, w).tolist()

            def ranges(literal: str) -> list[tuple[int, int]]:
                return find_highlight(lm.tokenizer, fmt, task.text, ids, ["lit:" + literal]).matches[0].token_ranges
            rec["answer"] = ranges(task.answer)
            rec["distractors"] = [ranges(d) for d in (task.distractors or [])]
            out.write(json.dumps(rec) + "\n")
            out.flush()
            print(task.id, flush=True)


def analyze(args) -> None:
    from kdnctl.compress.stages.select import shared_keep
    from kdnctl.scorers.sentences import two_rank_scores

    right = set()
    if args.results:
        data = json.loads(Path(args.results).read_text())
        right = {t["id"] for t in data["tasks"] if t["by_version"].get("full", {}).get("correct")}
    for path in args.dumps:
        recs = {}
        for line in open(path):
            r = json.loads(line)
            recs[r["id"]] = r
        print(f"\n{path}: {len(recs)} tasks, keep {args.keep}, protect {args.protect}")
        print("| weight a | answer kept | where the full cache answered right | mean cut rank | not kept (* full right) |")
        print("|---:|---:|---:|---:|---|")
        for a in args.weights:
            ok_n = right_n = right_ok = 0
            lost, cuts = [], []
            for r in recs.values():
                score = two_rank_scores(torch.tensor(r["tok"]), r["bounds"], torch.tensor(r[f"local{args.window}"]), a)
                rows = set(shared_keep(score[None, None], args.keep, r["header"], args.protect).tolist())
                ok = any(all(i in rows for i in range(x, y)) for x, y in r["answer"])
                cuts.append(min(float(score[i]) for i in rows if r["header"] <= i < r["T"] - args.protect))
                ok_n += ok
                if r["id"] in right:
                    right_n += 1
                    right_ok += ok
                if not ok:
                    lost.append(r["id"].rsplit("-", 1)[-1] + ("*" if r["id"] in right else ""))
            split = f"{right_ok}/{right_n}" if args.results else "-"
            print(f"| {a:g} | {ok_n}/{len(recs)} | {split} | {statistics.mean(cuts):.3f} | {' '.join(lost)} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--store", required=True)
    d.add_argument("--kinds", default="needle,multifact")
    d.add_argument("--tasks", default="", help="comma-separated task numbers (e.g. 019,022); default all")
    d.add_argument("--limit", type=int, default=100)
    d.add_argument("--windows", type=lambda v: [int(x) for x in v.split(",")], default=[64, 0])
    d.add_argument("--out", required=True)
    a = sub.add_parser("analyze")
    a.add_argument("dumps", nargs="+")
    a.add_argument("--window", type=int, default=64)
    a.add_argument("--weights", type=lambda v: [float(x) for x in v.split(",")], default=[0, 0.25, 0.5, 1, 2, 100])
    a.add_argument("--keep", type=float, default=0.33)
    a.add_argument("--protect", type=int, default=32)
    a.add_argument("--results", default=None, help="a bench/quality.py JSON: split by the full cache's answers")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dump(args) if args.cmd == "dump" else analyze(args)


if __name__ == "__main__":
    main()
