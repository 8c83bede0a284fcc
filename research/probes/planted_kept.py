"""Where a compressed version's word answers lose: was the sentence holding the answer kept?

    python research/probes/planted_kept.py RESULTS.json STORE [STORE ...] --labels A,B [--tasks examples/eval/realtext-words.jsonl]

For every task of ``RESULTS.json`` (a ``bench/quality.py --per-task`` run) whose document is in one
of the stores, finds the planted sentence that holds the answer in the document's stored tokens
(each token decoded alone, joined) and reads which of its tokens each version kept (layer 0's
positions; the defaults keep the same tokens in every layer and head). Prints per version: how
many answer sentences were kept whole, in part, or not at all, and per group the tasks' answers
right and the median answer NLL against the full cache's. Reads the stores only.
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

from kdnctl.format.bundle import decode_bundle  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def token_texts_of(st: Store, doc: str, tok) -> tuple[list[int], list[str]]:
    ids = [int(t) for c in st.get_version(doc, "full").chunks
           for t in decode_bundle(st.read_object(c.object)).tensors["token_ids"].tolist()]
    return ids, [tok.decode([i]) for i in ids]


def span_tokens(texts: list[str], needle: str) -> list[int]:
    """The token indices whose characters overlap the first occurrence of ``needle``."""
    starts, pos = [], 0
    for t in texts:
        starts.append(pos)
        pos += len(t)
    at = "".join(texts).find(needle)
    if at < 0:
        return []
    end = at + len(needle)
    return [j for j, s in enumerate(starts) if s < end and s + len(texts[j]) > at]


def kept_positions(st: Store, doc: str, label: str) -> set[int]:
    out: set[int] = set()
    for c in st.get_version(doc, label).chunks:
        out.update(int(p) for p in decode_bundle(st.read_object(c.object)).layer_positions(0)[0].tolist())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results")
    ap.add_argument("stores", nargs="+")
    ap.add_argument("--labels", required=True)
    ap.add_argument("--tasks", default=str(ROOT / "examples" / "eval" / "realtext-words.jsonl"))
    args = ap.parse_args()
    labels = args.labels.split(",")
    spec = {t["id"]: t for t in map(json.loads, Path(args.tasks).read_text().splitlines())}
    results = json.loads(Path(args.results).read_text())["tasks"]
    stores = [Store(Path(s)) for s in args.stores]
    tok = load_model(None).tokenizer
    groups: dict[str, dict[str, list]] = {lab: {"whole": [], "part": [], "none": [], "unfound": []} for lab in labels}
    for task in results:
        t = spec.get(task["id"])
        st = next((s for s in stores if any(d.doc_id == task["id"] for d in s.list_documents())), None)
        if t is None or st is None:
            continue
        ids, texts = token_texts_of(st, task["id"], tok)
        sentence = next((p for p in t.get("planted", []) if t["answer"] in p), None)
        span = span_tokens(texts, sentence) if sentence else []
        full = task["by_version"]["full"]
        for lab in labels:
            v = task["by_version"].get(lab)
            if v is None:
                continue
            if not span:
                key = "unfound"
            else:
                kept = kept_positions(st, task["id"], lab)
                n = sum(j in kept for j in span)
                key = "whole" if n == len(span) else ("none" if n == 0 else "part")
            groups[lab][key].append((bool(v["correct"]), bool(full["correct"]), v["nll"] / max(full["nll"], 1e-6)))
    print(f"{args.results}: answer sentence kept (layer 0 positions) and the answers, per version\n")
    print("| version | answer sentence | tasks | correct (full) | median answer NLL / full |")
    print("|---|---|---:|---:|---:|")
    for lab in labels:
        for key, rows in groups[lab].items():
            if rows:
                print(f"| {lab} | {key} | {len(rows)} | {sum(r[0] for r in rows)} ({sum(r[1] for r in rows)}) | "
                      f"{statistics.median(r[2] for r in rows):.2f}x |")


if __name__ == "__main__":
    main()
