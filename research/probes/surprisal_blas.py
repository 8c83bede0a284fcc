"""Ingest with surprisal's vocabulary logsumexp on numpy's BLAS (the product's host path,
``kdnctl.kernels.vocab.cpu``) against the same ingest on torch's matmul (the path before, kept as
the reference), and a bare prefill of the same tokens, in one run: interleaved repetitions, one
torch thread unless ``--threads`` (``bench/ttft.py``'s setting).

    python research/probes/surprisal_blas.py speed --sizes 1024,2048,4096 --repeats 3
    python research/probes/surprisal_blas.py ranks --tasks 40
    python research/probes/surprisal_blas.py scorer --sizes 1024,4096 --repeats 7 --threads 1,2
    python research/probes/surprisal_blas.py versions --tasks 4

``versions``: the first ``--tasks`` contexts of each task file ingested both ways and compressed
with the 0.25 default; how many loaded caches are equal element for element, and in the others
the share of K/V elements that differ.

``scorer``: the surprisal alone (both paths on the hidden states of one forward over the
document), interleaved, medians and paired ratios: what the ingest numbers above carry under the
noise of whole forwards.

``ranks``: on the contexts of the first ``--tasks`` tasks of ``examples/eval/realtext.jsonl`` and
``realtext-words.jsonl`` (one forward each, both paths on the same hidden states): the largest
difference in nats, and on how many contexts the order of the tokens by surprisal, or of the
sentences by their mean surprisal, differs between the two paths (what the scorers read).
"""
import argparse
import hashlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402

import ttft  # noqa: E402
from kdnctl.engine import prefill as pf  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.store import Store  # noqa: E402

PATH = {"host": True}
_init = pf.SurprisalScorer.__init__


def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.host = self.host and PATH["host"]


pf.SurprisalScorer.__init__ = init


def speed(lm, args) -> None:
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    rows = []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        warm = Document("warm.txt", ttft.corpus_text(lm.tokenizer, 300), "bench", "0" * 64)
        for host in (True, False):
            PATH["host"] = host
            ingest_documents(Store(tmp / f"warm-{host}"), lm, [warm], IngestOptions())
        for size in [int(s) for s in args.sizes.split(",")]:
            text = ttft.corpus_text(lm.tokenizer, size)
            doc = Document(f"bench-{size}.txt", text, "bench", hashlib.sha256(text.encode()).hexdigest())
            ids, _ = fmt.document_ids(lm.tokenizer, text)
            runs = {"bare": [], "torch": [], "host": []}
            stats = {"torch": [], "host": []}
            for r in range(args.repeats):
                order = ("torch", "host") if r % 2 == 0 else ("host", "torch")
                runs["bare"].append(pf.bare_prefill_seconds(lm.model, ids))
                for name in order:
                    PATH["host"] = name == "host"
                    d = tmp / f"ingest-{size}-{r}-{name}"
                    st = Store(d)
                    t = time.perf_counter()
                    rep = ingest_documents(st, lm, [doc], IngestOptions())
                    runs[name].append(time.perf_counter() - t)
                    stats[name].append(rep.prefill_seconds)
                    st.close()
                    shutil.rmtree(d)
            n = len(ids)
            best = {k: min(v) for k, v in runs.items()}
            paired = statistics.median(h / t for h, t in zip(runs["host"], runs["torch"]))
            rows.append((n, best, paired, {k: min(v) - best["bare"] for k, v in stats.items()}))
            print(f"{n} tokens: {json.dumps({k: [round(x, 3) for x in v] for k, v in runs.items()})}", flush=True)
    print(f"\ntorch threads {torch.get_num_threads()}; best of {args.repeats} interleaved runs each; "
          "statistics = the ingest's forward with its statistics minus the bare prefill\n")
    print("| tokens | bare prefill s | ingest s, torch matmul | ingest s, numpy BLAS | ingest / bare, torch | "
          "ingest / bare, numpy BLAS | statistics s, torch -> BLAS | ingest time BLAS / torch (paired median) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, b, paired, st in rows:
        print(f"| {n} | {b['bare']:.2f} | {b['torch']:.2f} | {b['host']:.2f} | {b['bare'] / b['torch']:.2f} | "
              f"{b['bare'] / b['host']:.2f} | {st['torch']:.2f} -> {st['host']:.2f} | {paired:.3f} |")


def scorer(lm, args) -> None:
    from kdnctl.models import adapter_for

    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    head = lm.model.get_output_embeddings()
    print("| tokens | torch threads | surprisal s, torch matmul | surprisal s, numpy BLAS | BLAS / torch (paired median) | s per 1k tokens, torch -> BLAS |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in [int(s) for s in args.sizes.split(",")]:
        ids, _ = fmt.document_ids(lm.tokenizer, ttft.corpus_text(lm.tokenizer, size))
        with torch.inference_mode():
            hidden = adapter_for(lm.model).decoder(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
        targets = torch.tensor(ids[1:])
        for th in [int(x) for x in str(args.threads).split(",")]:
            torch.set_num_threads(th)
            times = {True: [], False: []}
            for r in range(args.repeats + 1):
                for host in ((True, False) if r % 2 else (False, True)):
                    PATH["host"] = host
                    sc = pf.SurprisalScorer(head, torch.float32)
                    t = time.perf_counter()
                    with torch.inference_mode():
                        sc(hidden, targets)
                    if r:  # the first round warms both
                        times[host].append(time.perf_counter() - t)
            b, t_ = statistics.median(times[True]), statistics.median(times[False])
            paired = statistics.median(x / y for x, y in zip(times[True], times[False]))
            n = len(ids)
            print(f"| {n} | {th} | {t_:.3f} | {b:.3f} | {paired:.3f} | {1e3 * t_ / n:.3f} -> {1e3 * b / n:.3f} |", flush=True)


def versions(lm, args) -> None:
    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.engine.hf import load_document

    contexts = []
    for name in ("realtext.jsonl", "realtext-words.jsonl"):
        with open(ROOT / "examples" / "eval" / name) as f:
            contexts += [json.loads(line)["text"] for line in list(f)[:args.tasks]]
    equal, shares = 0, []
    with tempfile.TemporaryDirectory() as tmp_s:
        for i, text in enumerate(contexts):
            doc = Document(f"task-{i}.txt", text, "eval", hashlib.sha256(text.encode()).hexdigest())
            caches = {}
            for host in (True, False):
                PATH["host"] = host
                st = Store(Path(tmp_s) / f"{i}-{host}")
                ingest_documents(st, lm, [doc], IngestOptions())
                with st.writer():
                    compress_document(st, doc.doc_id, CompressRecipe(), lm=lm, label="b0.25")
                ctx = load_document(lm, st, doc.doc_id, "b0.25")
                caches[host] = torch.cat([*(k.flatten() for k in ctx.keys), *(v.flatten() for v in ctx.values)])
                st.close()
            diff = int((caches[True] != caches[False]).sum())
            equal += diff == 0
            shares.append(diff / caches[True].numel())
            print(f"context {i}: {caches[True].numel()} elements, {diff} differ", flush=True)
    print(f"{equal} of {len(contexts)} loaded 0.25 caches equal element for element; elements that differ: "
          f"{max(shares):.2e} at most")


def ranks(lm, args) -> None:
    from kdnctl.models import adapter_for
    from kdnctl.scorers.sentences import sentence_bounds, token_texts

    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    contexts = []
    for name in ("realtext.jsonl", "realtext-words.jsonl"):
        with open(ROOT / "examples" / "eval" / name) as f:
            contexts += [json.loads(line)["text"] for line in list(f)[:args.tasks]]
    head = lm.model.get_output_embeddings()
    worst, token_orders, sentence_orders, n_tokens, moved_tokens, farthest = 0.0, 0, 0, 0, 0, 0
    for text in contexts:
        ids, _ = fmt.document_ids(lm.tokenizer, text)
        with torch.inference_mode():
            hidden = adapter_for(lm.model).decoder(input_ids=torch.tensor([ids])).last_hidden_state[0, :-1]
            targets = torch.tensor(ids[1:])
            got = {}
            for host in (True, False):
                PATH["host"] = host
                got[host] = pf.SurprisalScorer(head, torch.float32)(hidden, targets)
        worst = max(worst, float((got[True] - got[False]).abs().max()))
        rank = {h: s.argsort(stable=True).argsort() for h, s in got.items()}
        moved = (rank[True] - rank[False]).abs()
        token_orders += bool(moved.any())
        moved_tokens += int((moved > 0).sum())
        farthest = max(farthest, int(moved.max()))
        bounds = sentence_bounds(token_texts(lm.tokenizer, ids[1:]))
        means = {h: torch.tensor([float(s[a:b].mean()) for a, b in bounds]) for h, s in got.items()}
        sentence_orders += not torch.equal(means[True].argsort(stable=True), means[False].argsort(stable=True))
        n_tokens += len(ids)
    print(f"{len(contexts)} contexts, {n_tokens} tokens: largest difference {worst:.2e} nats; token order "
          f"differs on {token_orders}, sentence order on {sentence_orders} of {len(contexts)}; {moved_tokens} tokens "
          f"change rank, none by more than {farthest} place(s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("speed", "ranks", "scorer", "versions"))
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=40)
    ap.add_argument("--threads", default="1", help="torch threads (scorer: comma-separated, each measured)")
    args = ap.parse_args()
    torch.set_num_threads(int(str(args.threads).split(",")[0]))
    lm = load_model(dtype="float32")
    {"speed": speed, "ranks": ranks, "scorer": scorer, "versions": versions}[args.mode](lm, args)


if __name__ == "__main__":
    main()
