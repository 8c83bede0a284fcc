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
* ``gap``          nowhere (the default's kept set); ``full`` every token everywhere.

``--sweep layers`` adds ``L:i`` for every layer, ``--sweep heads:A-B`` adds ``H:l.h`` for every
KV head of layers A..B: one variant at a time, to rank them. Rank on a task set the evaluation
does not use (``--tasks examples/eval/realtext-continuation.jsonl``, pages disjoint from
``realtext``), then measure the chosen set on ``realtext``.

One line per task and variant (``bench/selection_probe.py``'s format), a summary by
``python bench/head_probe.py --rank LOGS`` (the share of the kept set's gap each variant closes).
Diagnostics, not a recipe::

    python bench/head_probe.py --tasks examples/eval/realtext-continuation.jsonl --sweep layers > a.log
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
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
    from kdnctl.bundle import masking_bias

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
    import re

    runs: dict[str, dict[str, float]] = {}
    for f in logs:
        for line in Path(f).read_text().splitlines():
            m = re.match(r"(\S+) (\S+): (\{.*\}) \(", line)
            if m:
                runs.setdefault(m.group(2), {})[m.group(1)] = json.loads(m.group(3))["nll"]
    common = sorted(set.intersection(*(set(v) for v in runs.values())))
    mean = {v: sum(per[t] for t in common) / len(common) for v, per in runs.items()}
    full, gap = mean["full"], mean["gap"]
    print(f"{len(common)} tasks; full {full:.4f}, kept set {gap:.4f} ({100 * gap / full:.1f}% of full)")
    order = sorted(mean, key=mean.get)
    for v in order[:top]:
        print(f"{v:24s} {mean[v]:.4f} {100 * mean[v] / full:7.2f}%  closes {100 * (gap - mean[v]) / (gap - full):5.1f}%")
    return [v for v in order if v.startswith("H:") and "+" not in v]


def main() -> None:
    if sys.argv[1:2] == ["--rank"]:
        rank(sys.argv[2:])
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
    args = ap.parse_args()
    torch.set_num_threads(1)

    from bench.lowbit_probe import full_cache
    from kdnctl.compress import _cat_stats
    from kdnctl.compress_ec import shared_keep
    from kdnctl.engine.hf import LoadedContext
    from kdnctl.evaluation.tasks import ingest_tasks, load_tasks, run_task
    from kdnctl.model import load_model
    from kdnctl.prompting import PromptFormat
    from kdnctl.sentence_scores import (GAP_WEIGHT, local_sentence_surprisal, sentence_bounds, token_texts,
                                        two_rank_scores)
    from kdnctl.store import Store

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
        bounds = sentence_bounds(token_texts(lm.tokenizer, token_ids))
        local = local_sentence_surprisal(lm, token_ids, bounds)
        primary = two_rank_scores(surprisal, bounds, local, GAP_WEIGHT)
        kept = shared_keep(primary[None, None], args.keep, header, PROTECT)
        for var in variants:
            t0 = time.perf_counter()
            ks, vs, bias = variant_cache(var, keys, values, kept, group)
            ctx = LoadedContext(keys=[x[None] for x in ks], values=[x[None] for x in vs],
                                next_position=len(token_ids), token_ids=token_ids, bias=bias, label=var, doc_id=task.id)
            r = run_task(lm, ctx, task, fmt, 24)
            print(f"{task.id} {var}: {json.dumps(r)} ({time.perf_counter() - t0:.1f}s)", flush=True)


if __name__ == "__main__":
    main()
