"""A first compress as it is against an earlier revision's, on one ingested store: seconds, the
scale fit's probes, the scale found, the stored bytes and how far the codes move.

    python research/probes/fit_from_guess.py --rev 40df461 [--docs examples/corpus] [--budgets 0.25]
        [--only faq.md] [--repeats 2]

The documents are ingested once, by this checkout. Each compress runs in a child process of the
revision it measures (``git worktree`` of ``--rev`` in a temporary folder, or this checkout),
torch on 2 threads, the model loaded before the clock starts and the key weights forgotten (what
a first compress pays); the two revisions alternate which goes first. A probe is one scale the
fit sized (``PayloadSize.blob_sizes`` at a new scale). A bare prefill of each document (one
forward, logits of the last token only) is timed in the parent for the ratio. Prints medians of
``--repeats``, then per version the scale, the stored bytes and the codes that differ from the
earlier revision's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(args) -> None:
    """One compress in this process, with ``args.root``'s kdnctl; prints a JSON line."""
    sys.path.insert(0, str(args.root))
    import torch

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.compress.stages.payload_size import PayloadSize
    from kdnctl.models.load import load_model
    from kdnctl.quant.sensitivity import forget_key_weights
    from kdnctl.store import Store

    torch.set_num_threads(2)
    lm = load_model(None)
    scales = set()
    sized = PayloadSize.blob_sizes

    def counting(self, alpha):
        scales.add((id(self), alpha))
        return sized(self, alpha)

    PayloadSize.blob_sizes = counting
    st = Store(args.store)
    forget_key_weights()
    t0 = time.perf_counter()
    with st.writer():
        compress_document(st, args.doc, CompressRecipe(budget=args.budget), lm=lm, label=args.label)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "probes": len(scales)}))


def codes(st, doc: str, label: str):
    from kdnctl.format.bundle import decode_bundle
    from kdnctl.quant.entropy import decode_role_ints

    out, alpha, stored = [], None, 0
    for c in st.get_version(doc, label).chunks:
        raw = st.read_object(c.object)
        stored += len(raw)
        b = decode_bundle(raw)
        q = b.meta["quant"]
        alpha = q.get("alpha")
        for name in sorted(n for n in b.tensors if n.endswith(".codes")):
            layer = int(name.split(".")[1])
            pos = b.tensors.get(f"layers.{layer}.positions", b.tensors["positions"])
            out.append(decode_role_ints(b.tensors[name], b.tensors[name[:-5] + "params"], q["n_heads"], q["head_dim"],
                                        int(pos.shape[-1]), name, q["coding"])[0])
    return out, alpha, stored


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="40df461")
    ap.add_argument("--docs", default=str(ROOT / "examples" / "corpus"))
    ap.add_argument("--only", default="", help="comma-separated document ids (default: every document)")
    ap.add_argument("--budgets", default="0.25")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--root", type=Path)
    ap.add_argument("--store")
    ap.add_argument("--doc")
    ap.add_argument("--budget", type=float)
    ap.add_argument("--label")
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    sys.path.insert(0, str(ROOT))
    import torch

    from kdnctl.ingest import IngestOptions, ingest_documents
    from kdnctl.ingest.corpus import read_corpus
    from kdnctl.models.load import load_model
    from kdnctl.store import Store

    tmp = Path(tempfile.mkdtemp(prefix="fit-guess-"))
    old = tmp / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(old), args.rev], check=True)
    roots = {args.rev: old, "now": ROOT}
    store = tmp / "store"
    torch.set_num_threads(2)
    lm = load_model(None)
    corpus, _ = read_corpus([Path(args.docs)])
    if args.only:
        corpus = [d for d in corpus if d.doc_id in args.only.split(",")]
    st = Store(store)
    ingest_documents(st, lm, corpus, IngestOptions())
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from counted_fit import bare_prefill

    bare_prefill(lm, st, corpus[0].doc_id)  # (warm)
    bare = {d.doc_id: statistics.median(bare_prefill(lm, st, d.doc_id) for _ in range(args.repeats)) for d in corpus}
    st.close()
    del lm

    def run(root: Path, doc: str, budget: float, label: str) -> dict:
        out = subprocess.run([sys.executable, __file__, "--child", "--root", str(root), "--store", str(store),
                              "--doc", doc, "--budget", str(budget), "--label", label],
                             check=True, capture_output=True, text=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    for name, root in roots.items():  # numba compiles each checkout's kernels once, before any timing
        run(root, corpus[0].doc_id, float(args.budgets.split(",")[0]), f"warm-{name}")
    print(f"revisions: {args.rev} (as it was) and this checkout (now); torch threads 2; medians of {args.repeats}\n")
    print("| document | budget | bare prefill s | compress s, as it was | now | ratio | probes, as it was | now | alpha, as it was | now "
          "| stored bytes, as it was | now | codes that differ |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    totals = {}
    try:
        for budget in (float(b) for b in args.budgets.split(",")):
            for doc in corpus:
                res = {k: [] for k in roots}
                for r in range(args.repeats):
                    for name in (list(roots) if r % 2 == 0 else list(reversed(roots))):
                        res[name].append(run(roots[name], doc.doc_id, budget, f"b{budget:g}-{name}-{r}"))
                st = Store(store)
                (a, alpha_a, bytes_a), (b, alpha_b, bytes_b) = (codes(st, doc.doc_id, f"b{budget:g}-{k}-0") for k in roots)
                st.close()
                n = sum(x.numel() for x in a)
                moved = sum(int((x != y).sum()) for x, y in zip(a, b)) if len(a) == len(b) else n
                s_old, s_new = (statistics.median(x["seconds"] for x in res[k]) for k in roots)
                p_old, p_new = (res[k][0]["probes"] for k in roots)
                t = totals.setdefault(budget, [0.0, 0.0, 0.0])
                t[0] += s_old
                t[1] += s_new
                t[2] += bare[doc.doc_id]
                print(f"| {doc.doc_id} | {budget:g} | {bare[doc.doc_id]:.2f} | {s_old:.2f} | {s_new:.2f} | {s_new / s_old:.2f} | {p_old} | {p_new} "
                      f"| {alpha_a} | {alpha_b} | {bytes_a} | {bytes_b} | {moved} of {n} ({moved / n:.1e}) |", flush=True)
        for budget, (s_old, s_new, s_bare) in totals.items():
            print(f"\n{budget:g}: all documents {s_old:.2f} s as it was, {s_new:.2f} s now ({s_new / s_old:.2f}x); "
                  f"a bare prefill {s_bare:.2f} s: compress {s_old / s_bare:.2f}x as it was, {s_new / s_bare:.2f}x now")
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)


if __name__ == "__main__":
    main()
