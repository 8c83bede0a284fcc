"""Probe: does merging evicted tokens into kept ones recover what eviction loses at 0.083?

In memory, on the full (unquantized) cache: keep the default 0.083 recipe's token set (whole
sentences by ``sentences-local``, the prompt header and the last 64 tokens, ``keep`` of the
tokens, one set for every layer and KV head), then per variant:

* ``evict``   the kept tokens only (what the 0.083 default stores, before quantization);
* ``mergev``  each evicted token's value averaged into the kept token whose (post-RoPE) key is
  most similar (cosine, per layer and KV head); keys unchanged; nothing else stored;
* ``bias``    the kept tokens plus an attention bias log(1 + n_j) on kept token j, n_j = the
  evicted tokens assigned to it (the mass the softmax loses);
* ``mergevb`` both;
* ``full@A-B+C``  every token in layers A..B and C, the kept set in the others (where eviction
  costs);
* ``pyr:A-B:HI:LO``  the fraction HI of the tokens in layers A..B, LO in the others (nested sets
  by the same score; header and last tokens first);
* ``low:A-B:KB:VB``  the kept tokens exact, and in layers A..B the evicted ones too, coded in
  their principal axes at KB / VB bits per element (``lowbit_probe.klt_code``: keys before RoPE,
  one entropy-coded uniform step per head; "no token left behind" where eviction costs);
  ``lowe:`` the same without the rotation into principal axes (per-channel steps on keys
  before RoPE and Hadamard-rotated values: no basis to store);
* ``q:B[:A-B:E]``  the kept rows coded like ``lowe`` at B bits per element (the header in fp16),
  and in layers A..B the evicted rows at E bits: equal-bytes trades with the kept set quantized;
* ``qw:B:A-B:E[:EV]``  as ``q:`` (keys at E bits, values at EV, default E), but the evicted rows coded the way ``compress --backfill`` codes
  them: ec's attention-weighted steps (``relative_steps`` of the kept rows, keys weighted by the
  document's query energy, values by ``o_proj``, no rotation), the mean of every token
  subtracted, one scale per layer and role found by bisection for E bits (order-0 entropy);
  where ``q:`` and ``qw:`` differ is what the real path's step shapes cost;
* ``refit:RHO``  the kept tokens, values refitted by ridge least squares (weight RHO) so that
  the document's own queries, placed after it, get the full cache's attention output
  (``kdnctl/value_refit.py``, what ``compress --refit`` does);
* ``bgN``     the kept tokens plus N background tokens per layer and KV head: the mean key and
  value of N consecutive runs of evicted tokens, with bias log(run length).

Answers through the real engine (``run_task``). Diagnostics, not a recipe::

    python bench/merge_probe.py --store /tmp/mstore --kinds multifact --limit 20 > a.log
    python bench/merge_probe.py --summarize a.log b.log ...
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


DEFAULT_KEEP = 0.33  # a third of the tokens: the 0.083 default's kept fraction


def assign(k_post: torch.Tensor, kept: torch.Tensor, evicted: torch.Tensor, how: str) -> torch.Tensor:
    """[H, E] index into ``kept`` (positions of the kept tokens) for every evicted token."""
    if how == "prev":  # the nearest kept token before it (the context it was read in)
        j = torch.searchsorted(kept, evicted, right=True) - 1
        return j.clamp_min(0).expand(k_post.shape[0], -1)
    kn = torch.nn.functional.normalize(k_post, dim=-1)
    sim = kn[:, evicted] @ kn[:, kept].transpose(1, 2)  # [H, E, K]
    return sim.argmax(-1)


def merged(k, v, kept, evicted, how, merge_values: bool):
    """(keys, values, counts [H, K]) of the kept tokens with evicted values folded in."""
    H, T, D = k.shape
    a = assign(k, kept, evicted, how)  # [H, E]
    kk, vv = k[:, kept].clone(), v[:, kept].clone()
    cnt = torch.zeros(H, kept.numel())
    cnt.scatter_add_(1, a, torch.ones_like(a, dtype=torch.float))
    if merge_values:
        acc = vv.clone()
        acc.scatter_add_(1, a[..., None].expand(-1, -1, D), v[:, evicted])
        vv = acc / (1 + cnt)[..., None]
    return kk, vv, cnt


def coded(k, v, rows, kb: float, vb: float, basis: str, layer: int, header: int, theta: float):
    """(keys, values, bytes) of ``rows`` of k, v [H, T, D] coded by ``lowbit_probe.klt_code`` at
    kb / vb bits per element: keys before RoPE, values Hadamard-rotated unless basis is ``prev``
    (principal axes); the first ``header`` rows in fp16."""
    from bench.lowbit_probe import klt_code
    from kdnctl.quant import transforms as tf

    pos = rows.expand(k.shape[0], -1)
    ku = tf.unrope(k[:, rows], pos, theta)
    ve = v[:, rows] if basis == "prev" else tf.rotate(v[:, rows])
    kq, kbytes = klt_code(ku, kb, header, (layer, "k"), basis)
    vq, vbytes = klt_code(ve, vb, header, (layer, "v"), basis)
    return tf.rope(kq, pos, theta), vq if basis == "prev" else tf.rotate(vq), kbytes + vbytes


def weighted_coded(k, v, kept, evicted, kw, vw, key_bits: float, value_bits: float, theta: float):
    """(keys, values, bytes) of the ``evicted`` rows coded like ``--backfill`` (see ``qw:``)."""
    import math

    from bench.lowbit_probe import code_rate
    from kdnctl.allocate.rate import relative_steps
    from kdnctl.quant import transforms as tf

    H, T, D = k.shape
    out, nbytes = [], 0.0
    for x, w, bits in ((tf.unrope(k, torch.arange(T).expand(H, -1), theta), kw, key_bits), (v.float(), vw, value_bits)):
        base, mean = relative_steps(x[:, kept], w), x.mean(1)
        y = (x[:, evicted] - mean[:, None]) / base[:, None]
        target = bits * y.numel()

        def rate(scale):
            return sum(code_rate(y[h], scale)[1] for h in range(H))
        lo, hi = math.log(1e-3), math.log(4 * float(y.abs().max()) + 1e-9)
        for _ in range(25):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if rate(math.exp(mid)) > target else (lo, mid)
        scale = math.exp(hi)
        q = torch.stack([code_rate(y[h], scale)[0] for h in range(H)]).float()
        out.append(q * scale * base[:, None] + mean[:, None])
        nbytes += rate(scale) / 8 + H * D * 4
    pos = evicted.expand(H, -1)
    return tf.rope(out[0], pos, theta), out[1], nbytes


def summarize(logs: list[str]) -> None:
    """Per variant over the tasks every variant in ``logs`` answered: accuracy (n), mean NLL,
    and answers gained / lost against ``evict`` (the plain kept set)."""
    import re

    runs: dict[str, dict[str, dict]] = {}
    for f in logs:
        text = Path(f).read_text()
        k = re.search(r"summary \(keep (\S+),", text)
        # a run at another --keep than the default: its variants are named k<keep>/<variant>
        prefix = f"k{k.group(1)}/" if k and float(k.group(1)) != DEFAULT_KEEP else ""
        for line in text.splitlines():
            m = re.match(r"(\S+) (\S+): (\{.*\}) \(", line)
            if m:
                name = m.group(2) if m.group(2) == "full" else prefix + m.group(2)
                runs.setdefault(name, {})[m.group(1)] = json.loads(m.group(3))
    print_summary(runs)


def print_summary(runs: dict[str, dict[str, dict]]) -> None:
    common = sorted(set.intersection(*(set(v) for v in runs.values())))
    print(f"{len(common)} tasks answered by every variant")
    base = runs.get("evict", {})
    for var, per in runs.items():
        rs = [per[t] for t in common]
        acc = [r["correct"] for r in rs if "correct" in r]
        msg = f"{var:22s} nll {sum(r['nll'] for r in rs) / len(rs):.4f}"
        if acc:
            msg += f"  correct {sum(acc)}/{len(acc)}"
            if base and var != "evict":
                g = sum(per[t]["correct"] and not base[t]["correct"] for t in common)
                lo = sum(base[t]["correct"] and not per[t]["correct"] for t in common)
                msg += f"  vs evict +{g}/-{lo}"
        print(msg)


def main() -> None:
    if sys.argv[1:2] == ["--summarize"]:
        return summarize(sys.argv[2:])
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default="/tmp/mstore")
    ap.add_argument("--kinds", default="multifact")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--keep", type=float, default=DEFAULT_KEEP)
    ap.add_argument("--protect", type=int, default=64)
    ap.add_argument("--variants", default="full,evict,mergev,bias,mergevb")
    ap.add_argument("--assign", default="cos", help="cos | prev")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from bench.lowbit_probe import full_cache
    from kdnctl.compress.stages.score import cat_stats as _cat_stats
    from kdnctl.compress.stages.select import shared_keep
    from kdnctl.engine.hf import LoadedContext
    from kdnctl.evaluation.tasks import ingest_tasks, load_tasks, run_task
    from kdnctl.models.load import load_model
    from kdnctl.ingest.prompting import PromptFormat
    from kdnctl.quant.sensitivity import key_weights, value_weights
    from kdnctl.scorers import compute_importance
    from kdnctl.store import Store

    tasks = load_tasks("realtext", kinds=args.kinds.split(","), limit=args.limit + args.skip)[args.skip:]
    lm = load_model()
    store = Store(Path(args.store), create=True)
    ingest_tasks(lm, store, tasks)  # unchanged contexts are skipped
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    variants = args.variants.split(",")
    runs: dict[str, dict[str, dict]] = {}  # printed name -> task id -> record
    hq = lm.model.config.num_attention_heads
    for task in tasks:
        bundles, keys, values, token_ids = full_cache(store, task.id)
        L = len(keys)
        H, T, D = keys[0].shape
        header = int(bundles[0].meta.get("header_tokens", 0))
        theta = float((bundles[0].meta["model"].get("rope") or {}).get("rope_theta", 10000.0))
        stats = _cat_stats(bundles)
        imp = compute_importance("sentences-local", stats, lm=lm, keys=keys, values=values,
                                 token_ids=token_ids, n_layers=L, n_heads=H)
        score = imp.mean((0, 1)).clone()
        big = score.max() + 10
        score[:header] = big
        score[-args.protect:] = big
        n = max(1, round(args.keep * T))
        kept = shared_keep(imp, args.keep, header, args.protect)  # the set `compress --quant ec --keep` stores
        assert torch.equal(kept, score.topk(n).indices.sort().values)  # the pyr: variants nest by the same order
        order = score.argsort(descending=True)  # nested kept sets for per-layer fractions
        mask = torch.ones(T, dtype=torch.bool)
        mask[kept] = False
        evicted = mask.nonzero().flatten()
        extra: dict[str, float] = {}  # variant -> estimated bytes of the coarsely coded rows
        if any(x.startswith("qw:") for x in variants):  # ec's channel weights (what compress uses)
            kw = key_weights(lm, token_ids, L, H, D, rope=True)
            vw = value_weights(lm, L, H, D)
        if any(x.startswith("refit:") for x in variants):
            from kdnctl.compress.refit import QUESTION_OFFSET, document_queries, refit_values
            queries, scales = document_queries(lm, token_ids, L, T + QUESTION_OFFSET)
        for var in variants:
            t0 = time.perf_counter()
            ks, vs, bias = [], [], {}
            for i in range(L):
                k, v = keys[i], values[i]
                if var == "full":
                    ks.append(k), vs.append(v)
                    continue
                if var.startswith("pyr:"):  # pyr:A-B:HI:LO  keep HI in layers A..B, LO in the others
                    _, rng, hi, lo = var.split(":")
                    a, _, b = rng.partition("-")
                    frac = float(hi) if int(a) <= i <= int(b) else float(lo)
                    idx = order[: max(1, round(frac * T))].sort().values
                    ks.append(k[:, idx]), vs.append(v[:, idx])
                    continue
                if var.startswith("full@"):  # every token in these layers (a-b,c), the kept set elsewhere
                    sel = set()
                    for part in var[5:].split("+"):
                        a, _, b = part.partition("-")
                        sel.update(range(int(a), int(b or a) + 1))
                    idx = slice(None) if i in sel else kept
                    ks.append(k[:, idx]), vs.append(v[:, idx])
                    continue
                if var == "evict":
                    ks.append(k[:, kept]), vs.append(v[:, kept])
                    continue
                if var.startswith(("low:", "lowe:")):  # low:A-B:KB:VB  evicted rows coded coarsely in A..B
                    _, rng, kb, vb = var.split(":")
                    a, _, b = rng.partition("-")
                    if not int(a) <= i <= int(b):
                        ks.append(k[:, kept]), vs.append(v[:, kept])
                        continue
                    basis = "prev" if var.startswith("low:") else "eye"
                    kk, vv = k.clone(), v.clone()
                    kk[:, evicted], vv[:, evicted], nb = coded(k, v, evicted, float(kb), float(vb), basis, i, 0, theta)
                    extra[var] = extra.get(var, 0.0) + nb
                    ks.append(kk), vs.append(vv)
                    continue
                if var.startswith(("q:", "qw:")):  # q:B[:A-B:E]  kept rows at B bits, evicted rows of A..B at E bits
                    parts = var.split(":")
                    kk, vv = k.clone(), v.clone()
                    kk[:, kept], vv[:, kept], nb = coded(k, v, kept, float(parts[1]), float(parts[1]), "eye", i, header, theta)
                    extra[var] = extra.get(var, 0.0) + nb
                    a, _, b = (parts[2] if len(parts) > 2 else "-1--1").partition("-")
                    if len(parts) > 2 and int(a) <= i <= int(b):
                        eb = float(parts[3])
                        if var.startswith("qw:"):  # qw:B:A-B:E[:EV]  keys at E bits, values at EV (default E)
                            ev = float(parts[4]) if len(parts) > 4 else eb
                            kk[:, evicted], vv[:, evicted], nb = weighted_coded(k, v, kept, evicted, kw[i], vw[i], eb, ev, theta)
                        else:
                            kk[:, evicted], vv[:, evicted], nb = coded(k, v, evicted, eb, eb, "eye", i, 0, theta)
                        extra[var] += nb
                        ks.append(kk), vs.append(vv)
                    else:
                        ks.append(kk[:, kept]), vs.append(vv[:, kept])
                    continue
                if var.startswith("refit:"):  # refit:RHO  kept values refitted to the full attention
                    ks.append(k[:, kept])
                    vs.append(refit_values(queries[i], k, v, kept, scales[i], float(var[6:])).to(v.dtype))
                    continue
                if var.startswith("bg"):  # + background tokens: mean key/value of evicted spans, bias log n
                    nb = int(var[2:] or 1)
                    parts = evicted.tensor_split(nb)
                    kb = torch.stack([k[:, p].mean(1) for p in parts], 1)
                    vb = torch.stack([v[:, p].mean(1) for p in parts], 1)
                    ks.append(torch.cat([k[:, kept], kb], 1)), vs.append(torch.cat([v[:, kept], vb], 1))
                    b = torch.zeros(H, n + nb)
                    b[:, n:] = torch.tensor([float(p.numel()) for p in parts]).log()
                    bias[i] = b.repeat_interleave(hq // H, 0)
                    continue
                kk, vv, cnt = merged(k, v, kept, evicted, args.assign, var in ("mergev", "mergevb"))
                ks.append(kk), vs.append(vv)
                if var in ("bias", "mergevb"):
                    bias[i] = torch.log1p(cnt).repeat_interleave(hq // H, 0)
            ctx = LoadedContext(keys=[x[None] for x in ks], values=[x[None] for x in vs], next_position=T,
                                token_ids=token_ids, bias=bias, label=var, doc_id=task.id)
            r = run_task(lm, ctx, task, fmt, 24)
            if var in extra:  # the coded rows as a fraction of the document's fp16 K/V
                r["extra_fp16"] = round(extra[var] / (L * H * T * D * 4), 5)
            name = var if args.assign == "cos" or var in ("full", "evict") else f"{var}-{args.assign}"
            runs.setdefault(name, {})[task.id] = r
            print(f"{task.id} {name}: {json.dumps(r)} ({time.perf_counter() - t0:.1f}s)", flush=True)
    print(f"\nsummary (keep {args.keep}, assign {args.assign}):")
    print_summary(runs)
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
