"""A size-budgeted compress (`--budget`, 0.25 by default) of every document in a folder under two
kdnctl trees, alternating, in one run: seconds against a bare prefill of the same tokens, and
whether the two store the same tensors (where not: the largest gap between their loaded values,
in units of the values' spread).

    python research/probes/compress_time.py --trees OLD_TREE,NEW_TREE [--docs examples/corpus] [--budget 0.25]
        [--repeats 3] [--out DIR]

A tree is a checkout of this repository (``git worktree add DIR COMMIT``). The documents are
ingested once into a temporary store by the last tree, which also records the model's key basis
and Fisher profile there (what a model's first compress in a store measures once). Then each
repetition runs one worker process per tree (the order alternating between repetitions): it
loads SmolLM2 (fp32, torch on 2 threads), warms up, and per document times a bare prefill (one
forward, logits of the last token) and a `b0.25` compress into a label of its own. Medians over
repetitions per tree; the tensors of every chunk of every version are compared across trees.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def worker(tree: str, store_dir: str, docs_dir: str, label: str, prepare: bool, budget: float) -> None:
    sys.path.insert(0, tree)
    import torch

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.engine.prefill import bare_prefill_seconds
    from kdnctl.ingest import IngestOptions, ingest_documents
    from kdnctl.ingest.corpus import Document
    from kdnctl.ingest.prompting import PromptFormat
    from kdnctl.kernels.ec import deflate_size
    from kdnctl.models.load import load_model
    from kdnctl.quant.sensitivity import forget_key_weights
    from kdnctl.store import Store

    torch.set_num_threads(2)
    lm = load_model(dtype="float32")
    deflate_size.warm()
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    docs = []
    for p in sorted(Path(docs_dir).iterdir()):
        t = p.read_text()
        docs.append(Document(p.name, t, "probe", hashlib.sha256(t.encode()).hexdigest()))
    if prepare:
        st = Store(store_dir)
        ingest_documents(st, lm, docs, IngestOptions())
        with st.writer():  # the key basis and the Fisher profile, measured once
            compress_document(st, docs[0].doc_id, CompressRecipe(budget=0.25), lm=lm, label="prepare")
        st.close()
        return
    st = Store(store_dir, create=False)
    bare_prefill_seconds(lm.model, fmt.document_ids(lm.tokenizer, docs[0].text)[0])  # warm-up
    out = {}
    for d in docs:
        ids = fmt.document_ids(lm.tokenizer, d.text)[0]
        bare = bare_prefill_seconds(lm.model, ids)
        forget_key_weights()
        t = time.perf_counter()
        with st.writer():
            compress_document(st, d.doc_id, CompressRecipe(budget=budget), lm=lm, label=label)
        out[d.doc_id] = {"tokens": len(ids), "bare": bare, "compress": time.perf_counter() - t}
    st.close()
    print(json.dumps(out), flush=True)


def tensors_of(store_dir: str, tree: str, doc_id: str, label: str) -> list[dict[str, bytes]]:
    sys.path.insert(0, tree)
    from kdnctl.format.bundle import decode_bundle
    from kdnctl.store import Store

    st = Store(store_dir, create=False)
    try:
        return [{k: t.numpy().tobytes() for k, t in decode_bundle(st.read_object(c.object)).tensors.items()}
                for c in st.get_version(doc_id, label).chunks]
    finally:
        st.close()


def values_gap(store_dir: str, tree: str, doc_id: str, label_a: str, label_b: str) -> dict:
    """The two versions loaded as the loader rebuilds them: whether their keys are equal, the
    largest gap between their values over the values' standard deviation (per layer), and the
    share of value elements that differ."""
    sys.path.insert(0, tree)
    from kdnctl.engine.hf import load_document
    from kdnctl.models.load import load_model
    from kdnctl.store import Store

    lm = load_model(dtype="float32")
    st = Store(store_dir, create=False)
    try:
        a, b = load_document(lm, st, doc_id, label_a), load_document(lm, st, doc_id, label_b)
        keys_equal = all(torch_equal(x, y) for x, y in zip(a.keys, b.keys))
        gap = max(float((x - y).abs().max() / x.std()) for x, y in zip(a.values, b.values))
        moved = sum(int((x != y).sum()) for x, y in zip(a.values, b.values)) / sum(x.numel() for x in a.values)
        return {"keys_equal": keys_equal, "max_gap": gap, "share_moved": moved}
    finally:
        st.close()


def torch_equal(x, y) -> bool:
    return x.shape == y.shape and bool((x == y).all())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trees", help="OLD,NEW: two checkouts")
    ap.add_argument("--docs", default=str(HERE.parents[2] / "examples" / "corpus"))
    ap.add_argument("--budget", type=float, default=0.25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="folder for results.json")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--label", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prepare", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.store, args.docs, args.label, args.prepare, args.budget)
        return
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    names = ["old", "new"]

    def run(tree: str, *extra: str) -> str:
        cmd = [sys.executable, str(HERE), "--worker", tree, "--docs", args.docs, "--budget", str(args.budget), *extra]
        return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout

    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        run(trees[-1], "--store", store, "--prepare")
        for r in range(args.repeats):
            order = list(zip(names, trees)) if r % 2 == 0 else list(zip(names, trees))[::-1]
            for name, tree in order:
                got = json.loads(run(tree, "--store", store, "--label", f"t-{name}-{r}").strip().splitlines()[-1])
                runs[name].append(got)
                print(name, r, json.dumps({k: round(v["compress"] / v["bare"], 3) for k, v in got.items()}), flush=True)
        docs = list(runs[names[0]][0])
        same = {d: tensors_of(store, trees[-1], d, f"t-{names[0]}-0") == tensors_of(store, trees[-1], d, f"t-{names[1]}-0")
                for d in docs}
        gaps = {d: values_gap(store, trees[-1], d, f"t-{names[0]}-0", f"t-{names[1]}-0") for d in docs if not same[d]}
    table = {}
    for name in names:
        per_doc = {d: {k: statistics.median(run_[d][k] for run_ in runs[name]) for k in ("bare", "compress")}
                   for d in docs}
        tok = sum(runs[name][0][d]["tokens"] for d in docs) / 1000
        comp = sum(v["compress"] for v in per_doc.values())
        bare = sum(v["bare"] for v in per_doc.values())
        table[name] = {"compress_s_per_1k": comp / tok, "bare_s_per_1k": bare / tok, "compress_over_bare": comp / bare,
                       "per_doc": per_doc}
    paired = statistics.median(sum(a[d]["compress"] for d in docs) / sum(b[d]["compress"] for d in docs)
                               for a, b in zip(runs["new"], runs["old"]))
    print(f"\n{len(docs)} documents, {sum(runs['new'][0][d]['tokens'] for d in docs)} tokens, medians of {args.repeats}")
    print("| tree | compress s per 1k tokens | bare prefill s per 1k | compress / bare prefill |")
    print("|---|---:|---:|---:|")
    for name, tree in zip(names, trees):
        t = table[name]
        print(f"| {name} ({Path(tree).name}) | {t['compress_s_per_1k']:.2f} | {t['bare_s_per_1k']:.2f} | "
              f"{t['compress_over_bare']:.2f}x |")
    print(f"\nnew / old compress seconds, median of the repetitions' ratios: {paired:.2f}; "
          f"the same tensors in every document: {all(same.values())} {same}")
    for d, g in gaps.items():
        print(f"{d}: loaded keys equal: {g['keys_equal']}; values: largest gap {g['max_gap']:.2e} of their spread, "
              f"{g['share_moved']:.2e} of the elements moved")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps({"trees": trees, "table": table, "runs": runs,
                                                                  "same_tensors": same, "values_gap": gaps,
                                                                  "new_over_old": paired},
                                                                 indent=1) + "\n")


if __name__ == "__main__":
    main()
