"""Probe: which tokens should the 0.083 kept set spend its last share on, so that the text that
follows the document (continuation) comes back without losing needles or facts?

At 0.083 the default keeps a third of the tokens: whole sentences ranked by ``sentences-gap``,
the prompt header and the last 32 tokens. The continuation tasks it loses most on (GRANT.7's
repeated grammar, loginctl's option list, valgrind's ``--trace-children``) continue by copying
phrases the document already used; the sentences the surprisal ranking keeps are the surprising
ones, not the sources the next 64 tokens copy from. In memory, on the full (unquantized) cache,
every variant keeps the same number of tokens (``round(keep x T)``, header and tail forced) and
fills a share R of the non-forced ones by a second order instead of the ``sentences-gap`` rank:

* ``gap``          the default's kept set (no second order);
* ``recent:R``     the sentences nearest the end (before the protected tail) first;
* ``tail:R``       per sentence, the mean attention its tokens get from the document's last
                   ``--window`` queries in the middle layers (``kdnctl/tail_reads.py``, what
                   ``compress --tail-reads R`` keeps): what the end of the document reads, the
                   continuation reads next;
* ``rep:R``        per sentence, the share of its token 3-grams that occur elsewhere in the
                   document (copy sources), later sentences first among equals.

Answers through the real engine (``run_task``); one line per task and variant, a summary at the
end (``--summarize`` re-reads logs). Diagnostics, not a recipe::

    python bench/selection_probe.py --store /tmp/sstore --kinds continuation --limit 30 > a.log
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


def sentence_of(bounds: list[tuple[int, int]], t: int) -> torch.Tensor:
    """``[T]`` index of each token's sentence."""
    out = torch.zeros(t, dtype=torch.long)
    for s, (a, b) in enumerate(bounds):
        out[a:b] = s
    return out


def per_sentence(x: torch.Tensor, bounds) -> torch.Tensor:
    return torch.tensor([float(x[a:b].mean()) for a, b in bounds])


def repetition(token_ids: list[int], bounds) -> torch.Tensor:
    """``[S]`` share of each sentence's token 3-grams that occur elsewhere in the document."""
    grams: dict[tuple, list[int]] = {}
    for j in range(len(token_ids) - 2):
        grams.setdefault(tuple(token_ids[j:j + 3]), []).append(j)
    sid = sentence_of(bounds, len(token_ids))
    hit = torch.zeros(len(token_ids))
    for starts in grams.values():
        if len(starts) > 1:
            for j in starts:
                if any(int(sid[o]) != int(sid[j]) for o in starts):
                    hit[j:j + 3] = 1.0
    return per_sentence(hit, bounds)


def summarize(paths: list[str]) -> None:
    from bench.lowbit_probe import read_probe_logs

    runs = read_probe_logs(paths)
    common = set.intersection(*(set(r) for r in runs.values()))
    print(f"{len(common)} tasks in every variant")
    for kind in ("needle", "multifact", "continuation"):
        ids = sorted(t for t in common if f"/{kind}-" in t)
        if not ids:
            continue
        print(f"{kind} (n={len(ids)}):")
        full = runs.get("full", {})
        for var, per in sorted(runs.items(), key=lambda kv: kv[0] != "full"):  # full first
            nll = sum(per[t]["nll"] for t in ids) / len(ids)
            msg = f"  {var:16s} nll {nll:.4f}"
            if full and var != "full":
                msg += f" ({100 * nll / (sum(full[t]['nll'] for t in ids) / len(ids)):.1f}% of full)"
            if "correct" in per[ids[0]]:
                msg += f"  correct {sum(per[t]['correct'] for t in ids)}/{len(ids)}"
                if full and var != "full":  # answers only the full cache / only this variant gets right
                    lost = sum(bool(full[t]["correct"]) and not per[t]["correct"] for t in ids)
                    gained = sum(bool(per[t]["correct"]) and not full[t]["correct"] for t in ids)
                    msg += f"  vs full lost/gained {lost}/{gained}"
            print(msg)


def main() -> None:
    if sys.argv[1:2] == ["--summarize"]:
        return summarize(sys.argv[2:])
    from bench.lowbit_probe import probe_options

    ap = argparse.ArgumentParser()
    probe_options(ap, "/tmp/sstore", "continuation", 30, "full,gap,recent:0.25,tail:0.25,rep:0.25")
    ap.add_argument("--window", type=int, default=None, help="tail: the last queries read (default TAIL_WINDOW)")
    ap.add_argument("--keep", type=float, default=KEEP, help="fraction of the tokens every variant keeps")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from bench.lowbit_probe import full_cache, probe_setup
    from kdnctl.compress.stages.score import cat_stats as _cat_stats
    from kdnctl.compress.stages.select import shared_keep
    from kdnctl.engine.hf import LoadedContext
    from kdnctl.evaluation.tasks import run_task
    from kdnctl.engine.prefill import prefill
    from kdnctl.scorers.sentences import (GAP_WEIGHT, local_sentence_surprisal, sentence_bounds, token_texts,
                                        two_rank_scores)
    from kdnctl.scorers.tail_reads import TAIL_WINDOW, sentence_reads

    lm, store, tasks, fmt = probe_setup(args.store, args.kinds, args.limit, args.shard)
    for task in tasks:
        bundles, keys, values, token_ids = full_cache(store, task.id)
        T = keys[0].shape[1]
        header = int(bundles[0].meta.get("header_tokens", 0))
        surprisal = _cat_stats(bundles)["surprisal"].reshape(-1)
        bounds = sentence_bounds(token_texts(lm.tokenizer, token_ids))
        local = local_sentence_surprisal(lm, token_ids, bounds)
        primary = two_rank_scores(surprisal, bounds, local, GAP_WEIGHT)
        sid = sentence_of(bounds, T)
        pos = torch.arange(T, dtype=torch.float) / T * 1e-3  # later first among equals
        window = None
        for var in args.variants.split(","):
            t0 = time.perf_counter()
            if var == "full":
                ks, vs = keys, values
            else:
                name, _, rest = var.partition(":")
                parts = rest.split(":") if rest else []
                share = float(parts[0]) if parts else 0.0
                secondary = None
                if name == "recent":
                    secondary = sid.float() + pos
                elif name == "tail":  # what compress --tail-reads uses
                    if window is None:
                        window = prefill(lm.model, token_ids, stats=("window",), window=args.window or TAIL_WINDOW).stats["window"]
                    secondary = sentence_reads(window, bounds)
                elif name == "rep":
                    secondary = repetition(token_ids, bounds)[sid] + pos
                elif name != "gap":
                    raise SystemExit(f"unknown variant {var}")
                kept = shared_keep(primary[None, None], args.keep, header, PROTECT, secondary, share)
                ks, vs = [k[:, kept] for k in keys], [v[:, kept] for v in values]
            ctx = LoadedContext(keys=[x[None] for x in ks], values=[x[None] for x in vs], next_position=T,
                                token_ids=token_ids, bias={}, label=var, doc_id=task.id)
            r = run_task(lm, ctx, task, fmt, 24)
            print(f"{task.id} {var}: {json.dumps(r)} ({time.perf_counter() - t0:.1f}s)", flush=True)


if __name__ == "__main__":
    main()
