"""What packing the local surprisal's rows changes: time, and the sentences the 0.083 default keeps.

    python research/probes/local_pack.py [--tasks realtext,realtext-words] [--limit 20] [--packs 64,128,256]
    python research/probes/local_pack.py compress [--docs faq.md,meeting-notes-2026-03.txt] [--repeats 2]

``sentences-gap`` scores each sentence by its mean surprisal given only the 64 tokens before it
(``local_sentence_surprisal``), one forward row per sentence: ~(1 + 64 / sentence length) tokens
of forward per document token. With ``pack`` a row carries the sentences after its first while
they end within ``pack`` tokens of its start (``local_rows``). For each task context (the
prompt's document tokens as ingest stores them, the tune half of the word set only) this probe
times the exact rows and each pack in one process, alternating, and compares what the scores
choose: the tokens in the top half by ``sentences-gap`` (keep 0.5, whole sentences) and the top
30% of those (the lift), as the share of the exact choice's tokens that each pack also chooses.

``compress`` times a first compress at ``--budget 0.083`` of example documents (torch on two
threads, the key weights forgotten before each, so each pays its document queries' forward)
with rows of one sentence and with ``LOCAL_PACK``, alternating in one process, against a bare
prefill of the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.scorers.sentences import (GAP_WEIGHT, local_rows, local_sentence_surprisal, sentence_bounds,  # noqa: E402
                                      token_texts, two_rank_scores)


def whole_surprisal(lm, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = lm.model(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1)
    return torch.cat([torch.zeros(1), -lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]])


def top(scores: torch.Tensor, share: float) -> set[int]:
    k = int(round(share * scores.numel()))
    return set(torch.argsort(scores, descending=True)[:k].tolist())


def compress_ab(argv: list[str]) -> None:
    import hashlib
    import tempfile

    from kdnctl.compress.document import CompressRecipe, compress_document
    from kdnctl.engine.prefill import bare_prefill_seconds
    from kdnctl.ingest import IngestOptions, ingest_documents
    from kdnctl.ingest.corpus import Document
    from kdnctl.quant.sensitivity import forget_key_weights
    from kdnctl.scorers import sentences
    from kdnctl.store import Store

    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", default="faq.md,meeting-notes-2026-03.txt")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    lm = load_model(dtype="float32")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    packs = {"one sentence per row": 0, f"pack {sentences.LOCAL_PACK}": sentences.LOCAL_PACK}
    print("| document | tokens | bare prefill s | " + " | ".join(f"compress s, {k}" for k in packs)
          + " | " + " | ".join(f"/ bare, {k}" for k in packs) + " | packed / one per row |")
    print("|---|---:|---:|" + "---:|" * (2 * len(packs) + 1))
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "store")
        for name in args.docs.split(","):
            text = (ROOT / "examples" / "corpus" / name).read_text()
            doc = Document(name, text, "probe", hashlib.sha256(text.encode()).hexdigest())
            ids, _ = fmt.document_ids(lm.tokenizer, text)
            ingest_documents(store, lm, [doc], IngestOptions())
            secs: dict[str, list[float]] = {k: [] for k in packs}
            bare = []
            for rep in range(args.repeats):
                bare.append(min(bare_prefill_seconds(lm.model, ids) for _ in range(2)))
                for k, p in (packs.items() if rep % 2 == 0 else reversed(packs.items())):
                    sentences.LOCAL_PACK = p
                    forget_key_weights()
                    with store.writer():
                        t0 = time.perf_counter()
                        compress_document(store, doc.doc_id, CompressRecipe(budget=0.083), lm=lm,
                                          label=f"b0.083-p{p}-{rep}")
                        secs[k].append(time.perf_counter() - t0)
            b = statistics.median(bare)
            med = {k: statistics.median(v) for k, v in secs.items()}
            first, last = list(packs)
            print(f"| {name} | {len(ids)} | {b:.2f} | " + " | ".join(f"{med[k]:.2f}" for k in packs) + " | "
                  + " | ".join(f"{med[k] / b:.2f}x" for k in packs) + f" | {med[last] / med[first]:.3f} |", flush=True)


def main() -> None:
    if sys.argv[1:2] == ["compress"]:
        return compress_ab(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="realtext,realtext-words")
    ap.add_argument("--limit", type=int, default=20, help="tasks per set")
    ap.add_argument("--packs", default="64,128,256")
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_model(dtype="float32")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    packs = [int(p) for p in args.packs.split(",")]
    rows = []
    for name in args.tasks.split(","):
        tasks = [json.loads(line) for line in open(ROOT / "examples" / "eval" / f"{name}.jsonl")]
        tasks = [t for t in tasks if t.get("split", "tune") == "tune"]
        step = max(1, len(tasks) // args.limit)
        for t in tasks[::step][:args.limit]:
            ids, _ = fmt.document_ids(lm.tokenizer, t["text"])
            bounds = sentence_bounds(token_texts(lm.tokenizer, ids))
            s = whole_surprisal(lm, ids)
            secs, locals_ = {}, {}
            for p in [0] + packs:
                t0 = time.perf_counter()
                locals_[p] = local_sentence_surprisal(lm, ids, bounds, pack=p)
                secs[p] = time.perf_counter() - t0
            exact = two_rank_scores(s, bounds, locals_[0], GAP_WEIGHT)
            keep0, lift0 = top(exact, 0.5), top(exact, 0.15)
            rec = {"task": t["id"], "tokens": len(ids), "sentences": len(bounds), "exact_s": secs[0]}
            for p in packs:
                sc = two_rank_scores(s, bounds, locals_[p], GAP_WEIGHT)
                rec[f"p{p}"] = {"time": secs[p] / secs[0],
                                "rows": len(local_rows(bounds, pack=p)),
                                "keep": len(top(sc, 0.5) & keep0) / len(keep0),
                                "lift": len(top(sc, 0.15) & lift0) / max(1, len(lift0))}
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    print(f"\n{len(rows)} contexts, {statistics.median(r['tokens'] for r in rows):.0f} tokens median; "
          f"exact rows {statistics.median(r['exact_s'] for r in rows):.2f} s median (one thread)\n")
    print("| pack | time / exact rows (median) | kept tokens also kept (median, min) | lifted also lifted (median, min) |")
    print("|---:|---:|---:|---:|")
    for p in packs:
        v = [r[f"p{p}"] for r in rows]
        print(f"| {p} | {statistics.median(x['time'] for x in v):.3f} | {statistics.median(x['keep'] for x in v):.3f}, "
              f"{min(x['keep'] for x in v):.3f} | {statistics.median(x['lift'] for x in v):.3f}, {min(x['lift'] for x in v):.3f} |")


if __name__ == "__main__":
    main()
