"""Probe: which layers and KV heads need the evicted tokens for the text that follows a document?

At 0.083 the default keeps one set of tokens (a third: whole sentences by ``sentences-gap``,
the prompt header and the last 32 tokens) in every layer and KV head. Every token in layers
12-23 brings continuation NLL from 108.6% to 101.8% of the full cache (session 17), at 1.8x the
tokens. If a few heads do the copying (retrieval / induction heads, DuoAttention's observation),
every token in those heads alone should buy most of that for a small part of the bytes. In
memory, on the full (unquantized) cache, the kept set everywhere except:

* ``L:A-B+C``      every token in layers A..B and C (all their KV heads);
* ``H:l.h+l.h``    every token in KV head h of layer l (the other heads of that layer see the
                   kept set: their query heads get bundle.masking_bias on the evicted tokens,
                   what a reader of `compress --backfill L.H` adds);
* ``gap``          nowhere (the default's kept set); ``full`` every token everywhere;
* ``rec:VARIANT``  VARIANT over another kept set: every sentence holding a digit (the records a
                   multi-fact question picks from, ``kdnctl.scorers.literals.has_digit``) ranked
                   before every other sentence, each group by the default's ``sentences-gap``;
* ``ask:VARIANT``  an oracle: the kept set (beyond header and tail) is the sentences the task's
                   question reads most (its tokens' mean attention over the middle layers, one
                   prefill of the document and the question): what no offline scorer can know,
                   so what a third of the tokens can hold at best when chosen by sentence;
                   ``askt:`` the same by token.

``--own-tail N`` scores the document's own last N tokens (at most a quarter of it) instead of the
task: the cache holds the tokens before them (kept set and variants over those alone), so a
document can say, before any question, how much eviction costs the text that follows it (the
lines carry ``nll`` like a continuation's; ``--rank`` reads them).

``--sweep layers`` adds ``L:i`` for every layer, ``--sweep heads:A-B`` adds ``H:l.h`` for every
KV head of layers A..B: one variant at a time, to rank them. Rank on a task set the evaluation
does not use (``--tasks examples/eval/realtext-continuation.jsonl``, pages disjoint from
``realtext``), then measure the chosen set on ``realtext``.

One line per task and variant (``bench/selection_probe.py``'s format), a summary by
``python bench/head_probe.py --rank LOGS`` (the share of the kept set's gap each variant closes).
Diagnostics, not a recipe::

    python bench/head_probe.py --tasks examples/eval/realtext-continuation.jsonl --sweep layers > a.log
    python bench/head_probe.py --tasks examples/eval/realtext-continuation.jsonl --own-tail 64 > own.log
    python bench/head_probe.py --relate own.log -- a.log
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

KEEP, PROTECT = 0.33, 32


def parse_layers(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split("+"):
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def parse_heads(spec: str) -> set[tuple[int, int]]:
    return {(int(l), int(h)) for l, _, h in (p.partition(".") for p in spec.split("+"))}


def sweep(spec: str, n_layers: int, n_heads: int) -> list[str]:
    if spec == "layers":
        return [f"L:{i}" for i in range(n_layers)]
    if spec.startswith("heads:"):
        return [f"H:{l}.{h}" for l in sorted(parse_layers(spec[6:])) for h in range(n_heads)]
    raise SystemExit(f"unknown sweep {spec!r} (layers | heads:A-B)")


def variant_cache(var: str, keys, values, kept: torch.Tensor, group: int):
    """(keys, values, bias) per layer for one variant; ``group`` query heads per KV head."""
    from kdnctl.format.bundle import masking_bias

    n_layers, (n_heads, t, _) = len(keys), keys[0].shape
    full_layers: set[int] = set()
    heads: set[tuple[int, int]] = set()
    if var == "full":
        full_layers = set(range(n_layers))
    elif var.startswith("L:"):
        full_layers = parse_layers(var[2:])
    elif var.startswith("H:"):
        heads = parse_heads(var[2:])
    elif var != "gap":
        raise SystemExit(f"unknown variant {var!r}")
    evicted = torch.ones(t, dtype=torch.bool)
    evicted[kept] = False
    ks, vs, bias = [], [], {}
    for i in range(n_layers):
        wide = [h for h in range(n_heads) if (i, h) in heads]
        if i in full_layers:
            ks.append(keys[i]), vs.append(values[i])
        elif wide:  # every token stored; the narrow heads' queries are masked off the evicted ones
            ks.append(keys[i]), vs.append(values[i])
            narrow = [h for h in range(n_heads) if h not in wide]
            bias[i] = masking_bias(None, narrow, evicted, group * n_heads, n_heads)  # what a reader adds (KVBundle.layer_bias)
        else:
            ks.append(keys[i][:, kept]), vs.append(values[i][:, kept])
    return ks, vs, bias


def rank(logs: list[str], top: int = 40) -> list[str]:
    """Variants of ``logs`` by mean NLL over the tasks all of them answered, as a share of the
    gap between the kept set (``gap``) and ``full`` they close; prints the table, returns the
    single-head variants best first (what ``--wide`` sets are built from)."""
    runs = nll_logs(logs)
    common = sorted(set.intersection(*(set(v) for v in runs.values())))
    mean = {v: sum(per[t] for t in common) / len(common) for v, per in runs.items()}
    full, gap = mean["full"], mean["gap"]
    print(f"{len(common)} tasks; full {full:.4f}, kept set {gap:.4f} ({100 * gap / full:.1f}% of full)")
    order = sorted(mean, key=mean.get)
    for v in order[:top]:
        print(f"{v:24s} {mean[v]:.4f} {100 * mean[v] / full:7.2f}%  closes {100 * (gap - mean[v]) / (gap - full):5.1f}%")
    return [v for v in order if v.startswith("H:") and "+" not in v]


def nll_logs(logs: list[str]) -> dict[str, dict[str, float]]:
    """``{variant: {task id: nll}}`` of head_probe logs."""
    import re

    runs: dict[str, dict[str, float]] = {}
    for f in logs:
        for line in Path(f).read_text().splitlines():
            m = re.match(r"(\S+) (\S+): (\{.*\}) \(", line)
            if m:
                runs.setdefault(m.group(2), {})[m.group(1)] = json.loads(m.group(3))["nll"]
    return runs


def relate(own: list[str], real: list[str]) -> None:
    """Does a document's own tail (``--own-tail`` logs) foretell what eviction costs its real
    continuation (logs of the tasks)? Per task the kept set's NLL over the full cache's on
    each; their rank correlation, and the share of the real excess (ratio - 1, summed) held by
    the third of the documents whose own tail loses most (a third at random holds a third)."""
    o, r = nll_logs(own), nll_logs(real)
    tasks = sorted(set(o["gap"]) & set(o["full"]) & set(r["gap"]) & set(r["full"]))
    pairs = [(o["gap"][t] / o["full"][t], r["gap"][t] / r["full"][t], t) for t in tasks]

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        for k, j in enumerate(order):
            out[j] = float(k)
        return out

    def spearman(ps) -> float:
        a, b = ranks([p[0] for p in ps]), ranks([p[1] for p in ps])
        ma, mb = sum(a) / len(a), sum(b) / len(b)
        cov = sum((x - ma) * (y - mb) for x, y in zip(a, b))
        return cov / (sum((x - ma) ** 2 for x in a) * sum((y - mb) ** 2 for y in b)) ** 0.5

    def top_share(ps) -> float:
        top = sorted(ps, key=lambda p: -p[0])[: len(ps) // 3]
        return sum(p[1] - 1 for p in top) / sum(p[1] - 1 for p in ps)

    worst = max(pairs, key=lambda p: p[1])
    rest = [p for p in pairs if p is not worst]
    print(f"{len(pairs)} documents: rank correlation {spearman(pairs):.2f}, the top third by own tail holds "
          f"{100 * top_share(pairs):.0f}% of the real excess")
    print(f"without {worst[2]} (real {100 * worst[1]:.0f}% of full): rank correlation {spearman(rest):.2f}, "
          f"top third {100 * top_share(rest):.0f}%")
    print("| task | own tail: kept / full | real continuation: kept / full |\n|---|---:|---:|")
    for a, b, t in sorted(pairs, key=lambda p: -p[0]):
        print(f"| {t} | {100 * a:.1f}% | {100 * b:.1f}% |")


def main() -> None:
    if sys.argv[1:2] == ["--rank"]:
        rank(sys.argv[2:])
        return
    if sys.argv[1:2] == ["--relate"]:  # --relate OWN_LOGS -- REAL_LOGS
        args = sys.argv[2:]
        relate(args[: args.index("--")], args[args.index("--") + 1:])
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default="/tmp/hstore")
    ap.add_argument("--tasks", default="realtext", help="a named set or a task .jsonl")
    ap.add_argument("--kinds", default="continuation")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--shard", default="0/1", help="I/N: every Nth task from the Ith")
    ap.add_argument("--variants", default="full,gap")
    ap.add_argument("--sweep", default=None, help="layers | heads:A-B (one variant per layer or KV head)")
    ap.add_argument("--keep", type=float, default=KEEP)
    ap.add_argument("--tag", default="", help="prefix of the variants' names in the log (e.g. k50 for --keep 0.5)")
    ap.add_argument("--own-tail", type=int, default=0, metavar="N",
                    help="score the document's last N tokens over a cache of the rest instead of the task")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.own_tail and any(v.split(":")[0] in ("ask", "askt") for v in args.variants.split(",")):
        raise SystemExit("ask:/askt: read the task's question; --own-tail scores no question (drop one of them)")

    from bench.lowbit_probe import full_cache
    from kdnctl.compress.stages.score import cat_stats as _cat_stats
    from kdnctl.compress.stages.select import shared_keep
    from kdnctl.engine.hf import LoadedContext
    from kdnctl.evaluation.tasks import ingest_tasks, load_tasks, run_task
    from kdnctl.scorers.literals import SENTENCE, literal_scores
    from kdnctl.models.load import load_model
    from kdnctl.ingest.prompting import PromptFormat
    from kdnctl.scorers.sentences import (GAP_WEIGHT, local_sentence_surprisal, sentence_bounds, token_texts,
                                        two_rank_scores)
    from kdnctl.store import Store
    from kdnctl.scorers.tail_reads import middle_layers, sentence_reads

    i, n = (int(x) for x in args.shard.split("/"))
    tasks = load_tasks(args.tasks, kinds=args.kinds.split(","), limit=args.limit)[i::n]
    lm = load_model()
    cfg = lm.model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    variants = args.variants.split(",")
    if args.sweep:
        variants += sweep(args.sweep, cfg.num_hidden_layers, cfg.num_key_value_heads)
    store = Store(Path(args.store), create=True)
    ingest_tasks(lm, store, tasks)
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    for task in tasks:
        bundles, keys, values, token_ids = full_cache(store, task.id)
        header = int(bundles[0].meta.get("header_tokens", 0))
        surprisal = _cat_stats(bundles)["surprisal"].reshape(-1)
        texts = token_texts(lm.tokenizer, token_ids)
        bounds = sentence_bounds(texts)
        local = local_sentence_surprisal(lm, token_ids, bounds)
        primary = two_rank_scores(surprisal, bounds, local, GAP_WEIGHT)
        # literal_scores' upper classes are the tokens of every sentence holding a digit
        records = primary + RECORD_BONUS * (literal_scores(surprisal, texts) >= SENTENCE).float()
        # --own-tail: the cache is the document before its last n tokens, which are scored after it
        n = min(args.own_tail, len(token_ids) // 4)
        end = len(token_ids) - n
        kept = {name: shared_keep(score[None, None, :end], args.keep, header, PROTECT)
                for name, score in (("gap", primary), ("rec", records))}
        if not n and any(v.startswith("ask") for v in variants):  # the oracle: what the question reads
            reads = question_reads(lm, token_ids, fmt.question_ids(lm.tokenizer, task.question))
            per_token = reads[list(middle_layers(len(keys)))].double().mean((0, 1))
            kept["ask"] = shared_keep(primary[None, None], args.keep, header, PROTECT, sentence_reads(reads, bounds), 1.0)
            kept["askt"] = shared_keep(primary[None, None], args.keep, header, PROTECT, per_token, 1.0)
        pk, pv = ([x[:, :end] for x in keys], [x[:, :end] for x in values]) if n else (keys, values)
        for var in variants:
            t0 = time.perf_counter()
            which, _, base = var.partition(":") if var.split(":")[0] in ("rec", "ask", "askt") else ("gap", "", var)
            ks, vs, bias = variant_cache(base, pk, pv, kept[which], group)
            ctx = LoadedContext(keys=[x[None] for x in ks], values=[x[None] for x in vs],
                                next_position=end, token_ids=token_ids[:end], bias=bias, label=var, doc_id=task.id)
            r = own_tail_nll(lm, ctx, token_ids[end:]) if n else run_task(lm, ctx, task, fmt, 24)
            name = f"{args.tag}/{var}" if args.tag else var
            print(f"{task.id} {name}: {json.dumps(r)} ({time.perf_counter() - t0:.1f}s)", flush=True)


def question_reads(lm, token_ids: list[int], suffix: list[int]) -> torch.Tensor:
    """``[L, H, T]``: the attention the question's tokens (``suffix``, after the document) pay
    each document token, from one prefill of both (``prefill``'s ``window`` statistic)."""
    from kdnctl.engine.prefill import prefill

    stats = prefill(lm.model, token_ids + suffix, stats=("window",), window=len(suffix)).stats["window"]
    return stats[..., :len(token_ids)]


RECORD_BONUS = 10.0  # above any sentences-gap score: a sentence with a digit ranks before every other


def own_tail_nll(lm, ctx, tail: list[int]) -> dict:
    """Mean NLL of ``tail[1:]`` teacher-forced after ``ctx`` (the first tail token has no
    prediction from the cache alone)."""
    from kdnctl.engine.hf import forward_suffix

    logits, _ = forward_suffix(lm, ctx, tail)
    logp = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(tail[1:])[:, None])
    return {"nll": round(-float(logp.mean()), 5), "n_scored": len(tail) - 1}


if __name__ == "__main__":
    main()
