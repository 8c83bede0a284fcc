"""Steering on full and compressed versions, measured in one run.

    python bench/steer.py [--alpha 0.01] [--budget 0.5] [--max-new-tokens 32]

Ingests the steering task set (examples/steering/tasks.jsonl) into a temporary store, compresses
every task document with kvcrush at --budget and with int8 alone, and runs the same evaluation
as ``kdnctl eval-steer`` (no edit vs ``edit --steer`` in bias and reprefill mode, shipped head
config) on each source version. Reprefill is skipped for the quantized source, which it refuses.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.evaluation.steering import evaluate_steering, load_tasks, task_document  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.steer.heads import resolve_heads  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default=str(ROOT / "examples" / "steering" / "tasks.jsonl"))
    ap.add_argument("--alpha", type=float, default=0.01)
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args()
    lm = load_model()
    tasks = load_tasks(args.tasks)
    heads, spec = resolve_heads("auto", lm)
    sources = {"full": ("bias", "reprefill")}
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        ingest_documents(store, lm, [task_document(t) for t in tasks], IngestOptions())
        pruned = CompressRecipe(budget=None, keep=args.budget)
        int8 = CompressRecipe(budget=None, keep=1.0, quant="int8")
        with store.writer():
            for t in tasks:
                compress_document(store, t.id, pruned, lm=lm, fingerprint=lm.fingerprint)
                compress_document(store, t.id, int8, lm=lm, fingerprint=lm.fingerprint)
        sources[pruned.default_label()] = ("bias", "reprefill")
        sources[int8.default_label()] = ("bias",)
        print(f"| source version | mode | alpha {args.alpha:g} accuracy | counterfact | instruction |")
        print("|---|---|---:|---:|---:|")
        for source, modes in sources.items():
            rep = evaluate_steering(lm, store, tasks, heads=heads, heads_spec=spec, source=source,
                                    alphas=(args.alpha,), modes=modes, max_new_tokens=args.max_new_tokens)
            for r in rep["results"]:
                kinds = r["by_kind"]
                print(f"| {source} | {r['mode']} | {r['n_correct']}/{r['n']} = {r['accuracy']:.2f} | "
                      f"{kinds.get('counterfact', 0):.2f} | {kinds.get('instruction', 0):.2f} |", flush=True)


if __name__ == "__main__":
    main()
