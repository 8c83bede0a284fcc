"""Probe: which stored rows of a 0.083 version does a multi-fact answer need at full precision?

At 0.083 the default's kept set, unquantized, answers about as many facts as the full cache
(``bench/selection_probe.py --kinds multifact --limit 40 --variants full,gap``), while the
stored versions answer three fewer on average (``bench/answer_stability.py``). This probe reads a
real stored version (``--recipe``, compressed through ``kdnctl compress`` into ``--store``) and
puts the full cache's rows back for one part of its kept set at a time:

* ``full``          the full cache; ``kept`` the version's kept set, every row unquantized;
* ``q``             the version as stored (what the quality run loads); ``q:LABEL`` another
                    ``--recipe``'s version as stored;
* ``fp:keys`` / ``fp:values``   that role unquantized in every layer;
* ``fp:L:A-B+C``    keys and values of layers A..B and C unquantized;
* ``fp:records``    the rows of every sentence holding a digit (the records and their values:
                    the ``literals`` scorer's upper two classes), all layers;
* ``fp:digits``     the rows of the tokens holding a digit, all layers;
* parts combine, each narrowing one axis: ``fp:keys:records`` the records' keys only,
  ``fp:keys:L:10-19:digits`` the digits' keys in layers 10..19.

Besides the greedy answer, each line has ``margin``: after the question and the asked record's
own words ("The port for the marlin service is"), the teacher-forced log-probability of the
asked value minus the best of the other records' values (``distractors``), summed over the
value's tokens: the choice the greedy answer makes, as a number. A count flips on near ties; the margin shows which way a variant moves them.
Only versions with one kept set for every layer and head (the default, ``--lift``) are read.
Diagnostics, not a recipe::

    python bench/precision_probe.py --store /tmp/pstore --shard 0/2 > a.log
    python bench/precision_probe.py --summarize a.log b.log
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch
from kdnctl.quant import layer_kv

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VARIANTS = "full,kept,q,fp:keys,fp:values,fp:L:0-9,fp:L:10-19,fp:L:20-29,fp:records,fp:digits"


def value_logprob(lm, ctx, suffix: list[int], value: str) -> float:
    """Teacher-forced log-probability of `` value``'s tokens right after ``suffix``."""
    from kdnctl.engine.hf import forward_suffix

    target = lm.tokenizer(" " + value, add_special_tokens=False).input_ids
    logits, _ = forward_suffix(lm, ctx, suffix + target)
    logp = torch.log_softmax(logits[len(suffix) - 1: len(suffix) - 1 + len(target)], dim=-1)
    return float(logp.gather(1, torch.tensor(target)[:, None]).sum())


def record_lead(text: str, value: str) -> str:
    """The words of the sentence holding ``value`` before it ("The port for the marlin service is")."""
    at = text.find(value)
    if at < 0:
        return ""
    start = max(text.rfind(". ", 0, at) + 2, text.rfind("\n", 0, at) + 1, 0)
    return text[start:at].strip()


def stored_rows(bundles) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(kept positions [n], keys [L x [H, n, D]], values) of a version with one kept set."""
    n_layers = bundles[0].n_layers
    pos = torch.cat([b.layer_positions(0)[0] for b in bundles])
    ks, vs = [], []
    for i in range(n_layers):
        p = torch.cat([b.layer_positions(i) for b in bundles], 1)
        if not bool((p == pos).all()):
            raise SystemExit("the version has more than one kept set (wide heads?): not read here")
        kv = [layer_kv(b, i) for b in bundles]
        ks.append(torch.cat([k for k, _ in kv], 1).float()), vs.append(torch.cat([v for _, v in kv], 1).float())
    return pos, ks, vs


def variant_rows(var: str, kept: torch.Tensor, full_k, full_v, q_k, q_v, record_tok, digit_tok):
    """(keys, values) per layer over the kept set for one variant (``full`` handled by the caller)."""
    if var == "kept":
        return [k[:, kept] for k in full_k], [v[:, kept] for v in full_v]
    if var == "q":
        return q_k, q_v
    if not var.startswith("fp:"):
        raise SystemExit(f"unknown variant {var!r}")
    n = len(full_k)
    layers, roles, rows = set(range(n)), {"keys", "values"}, torch.ones(len(kept), dtype=torch.bool)
    parts = var[3:].split(":")
    while parts:  # each part narrows one axis: a role, a layer range (L:A-B), a token class
        p = parts.pop(0)
        if p in ("keys", "values"):
            roles = {p}
        elif p == "L" and parts:
            from bench.head_probe import parse_layers

            layers = parse_layers(parts.pop(0))
        elif p in ("records", "digits"):
            rows = (record_tok if p == "records" else digit_tok)[kept]
        else:
            raise SystemExit(f"unknown variant {var!r}")
    ks, vs = [], []
    for i in range(n):
        k, v = q_k[i].clone(), q_v[i].clone()
        if i in layers:
            if "keys" in roles:
                k[:, rows] = full_k[i][:, kept[rows]]
            if "values" in roles:
                v[:, rows] = full_v[i][:, kept[rows]]
        ks.append(k), vs.append(v)
    return ks, vs


def summarize(paths: list[str]) -> None:
    """Per variant over the tasks every variant answered: right answers, tasks with a positive
    margin, mean and median margin, answer NLL / the full cache's, and answers lost / gained
    against the full cache."""
    import statistics as st

    from bench.lowbit_probe import read_probe_logs

    runs = read_probe_logs(paths)
    common = sorted(set.intersection(*(set(r) for r in runs.values())))
    full = runs["full"]
    full_nll = st.mean(full[t]["nll"] for t in common)
    print(f"{len(common)} tasks in every variant\n")
    print("| variant | right (n) | margin > 0 | mean margin | median margin | answer NLL / full | vs full: lost / gained |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for var, per in runs.items():
        m = [per[t]["margin"] for t in common]
        lost = sum(full[t]["correct"] and not per[t]["correct"] for t in common)
        gained = sum(per[t]["correct"] and not full[t]["correct"] for t in common)
        print(f"| {var} | {sum(per[t]['correct'] for t in common)}/{len(common)} | {sum(x > 0 for x in m)} | "
              f"{st.mean(m):+.3f} | {st.median(m):+.3f} | {100 * st.mean(per[t]['nll'] for t in common) / full_nll:.1f}% | "
              f"{lost} / {gained} |")


def main() -> None:
    if sys.argv[1:2] == ["--summarize"]:
        return summarize(sys.argv[2:])
    from bench.lowbit_probe import probe_options

    ap = argparse.ArgumentParser()
    probe_options(ap, "/tmp/pstore", "multifact", 40, VARIANTS)
    ap.add_argument("--recipe", action="append", default=None,
                    help="kdnctl compress arguments with --label (may repeat: variant q:LABEL reads that one, q the first)")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from bench.lowbit_probe import full_cache, probe_setup
    from bench.quality import run_compress
    from kdnctl.format.bundle import decode_bundle
    from kdnctl.engine.hf import LoadedContext
    from kdnctl.errors import NotFoundError
    from kdnctl.evaluation.tasks import run_task
    from kdnctl.scorers.literals import has_digit
    from kdnctl.scorers.sentences import sentence_bounds, token_texts

    recipes = [shlex.split(r) for r in (args.recipe or ["--budget 0.083 --label q083"])]
    labels = [r[r.index("--label") + 1] for r in recipes]
    lm, store, tasks, fmt = probe_setup(args.store, args.kinds, args.limit, args.shard)
    for task in tasks:
        bundles, full_k, full_v, token_ids = full_cache(store, task.id)
        first = int(bundles[0].tensors["positions"][0])
        stored = {}
        for recipe, label in zip(recipes, labels):
            try:
                store.get_version(task.id, label)
            except NotFoundError:
                run_compress(recipe, Path(args.store), [task.id])
            ver = store.get_version(task.id, label)
            stored[label] = stored_rows([decode_bundle(store.read_object(c.object)) for c in ver.chunks])
        texts = token_texts(lm.tokenizer, token_ids)
        digit_tok = torch.tensor([has_digit(t) for t in texts])
        record_tok = torch.zeros(len(texts), dtype=torch.bool)
        for a, b in sentence_bounds(texts):
            record_tok[a:b] = bool(digit_tok[a:b].any())
        suffix = fmt.question_ids(lm.tokenizer, task.question)
        lead = suffix + lm.tokenizer(record_lead(task.text, task.answer), add_special_tokens=False).input_ids
        for var in args.variants.split(","):
            t0 = time.perf_counter()
            label = var[2:] if var.startswith("q:") else labels[0]
            kept_pos, q_k, q_v = stored[label]
            kept = kept_pos - first
            ks, vs = (full_k, full_v) if var == "full" else variant_rows("q" if var.startswith("q:") else var, kept,
                                                                        full_k, full_v, q_k, q_v, record_tok, digit_tok)
            ctx = LoadedContext(keys=[x[None] for x in ks], values=[x[None] for x in vs], next_position=len(token_ids),
                                token_ids=token_ids, bias={}, label=var, doc_id=task.id)
            r = run_task(lm, ctx, task, fmt, 24)
            right = value_logprob(lm, ctx, lead, task.answer)
            others = max(value_logprob(lm, ctx, lead, d) for d in task.distractors) if task.distractors else 0.0
            r.update(margin=round(right - others, 4), kept=len(kept))
            print(f"{task.id} {var}: {json.dumps(r)} ({time.perf_counter() - t0:.1f}s)", flush=True)


if __name__ == "__main__":
    main()
