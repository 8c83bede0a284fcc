"""Probe: where the planted answer sits in stored versions: kept or evicted, and at what level.

For every needle and multi-fact task of a ``bench/quality.py`` run, read each ``--labels``
version from the run's stores (``--stores``, the shards' ``--store`` folders) and find the
answer's tokens (the steering edit's span finder over the document's ids): are they all kept
(layer 0's kept set), and the lowest ``ec`` token level among them (steps ``2**level`` times
finer than level 0; the header and the forced tail sit at 2). With ``--results`` (the run's
``quality.json``) each version's answers are split by where the answer sat, so a lift that
reaches the answer but does not move the count shows as such. Reads the stores only: no model
pass beyond the tokenizer::

    python bench/answer_levels.py --stores /tmp/qstore0,/tmp/qstore1 --labels lit08x2,lit20x2 \\
        --results R/quality.json > R/answer-levels.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def answer_levels(bundles, ranges: list[tuple[int, int]]) -> int | None:
    """The best occurrence's lowest level over the answer's tokens, or None where no occurrence
    is kept whole (``bundles``: a version's decoded chunks, in order)."""
    positions = torch.cat([b.tensors["positions"] for b in bundles])
    kept = torch.cat([b.layer_positions(0)[0] for b in bundles])
    levels = torch.cat([b.tensors["token_levels"] if "token_levels" in b.tensors else b.layer(0, "levels")
                        for b in bundles])
    level_at = {int(p): int(lv) for p, lv in zip(kept.tolist(), levels.tolist())}
    best = None
    for a, c in ranges:
        got = [level_at.get(int(positions[j])) for j in range(a, c)]
        if got and None not in got:
            best = min(got) if best is None else max(best, min(got))
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stores", required=True, help="comma-separated store folders (a quality run's shards)")
    ap.add_argument("--labels", required=True, help="comma-separated version labels")
    ap.add_argument("--results", default=None, help="the run's quality.json: split each version's answers by level")
    ap.add_argument("--kinds", default="needle,multifact")
    args = ap.parse_args()

    from kdnctl.format.bundle import decode_bundle
    from kdnctl.evaluation.tasks import load_tasks
    from kdnctl.models.load import load_model
    from kdnctl.ingest.prompting import PromptFormat
    from kdnctl.steer.highlight import find_highlight
    from kdnctl.store import Store

    lm = load_model()
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    labels = args.labels.split(",")
    stores = [Store(Path(s)) for s in args.stores.split(",")]
    results = {}
    if args.results:
        results = {t["id"]: t["by_version"] for t in json.loads(Path(args.results).read_text())["tasks"]}
    tally: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])  # (label, kind, where) -> [right, tasks]
    store_of = {d.doc_id: s for s in reversed(stores) for d in s.list_documents()}  # the first store holding it
    for task in load_tasks("realtext", kinds=args.kinds.split(",")):
        st = store_of.get(task.id)
        if st is None:
            continue
        full = [decode_bundle(st.read_object(c.object)) for c in st.get_version(task.id, "full").chunks]
        ids = [int(t) for b in full for t in b.token_ids.tolist()]
        ranges = find_highlight(lm.tokenizer, fmt, task.text, ids, ["lit:" + task.answer]).matches[0].token_ranges
        row = {"task": task.id}
        for label in labels:
            bundles = [decode_bundle(st.read_object(c.object)) for c in st.get_version(task.id, label).chunks]
            level = answer_levels(bundles, ranges)
            where = "evicted" if level is None else f"level {level}"
            row[label] = where
            right = results.get(task.id, {}).get(label, {}).get("correct")
            t = tally[(label, task.kind, where)]
            t[0] += bool(right)
            t[1] += 1
        print(json.dumps(row), file=sys.stderr, flush=True)
    print("| version | kind | the answer's tokens | tasks | answered right |")
    print("|---|---|---|---:|---:|")
    for (label, kind, where), (right, n) in sorted(tally.items()):
        print(f"| {label} | {kind} | {where} | {n} | {right if results else '-'} |")


if __name__ == "__main__":
    main()
