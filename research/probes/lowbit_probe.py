"""Probe what makes a 12x (0.083) size budget keep the answers, by fake-quantizing the full
cache in memory (quantize + dequantize with the repo's kernels and transforms) and answering the
real-text tasks from it. Nothing is written to the store; bytes are estimated per row.

    python bench/lowbit_probe.py --store .bench-quality --kinds needle --limit 6 --variants v1,v2

Each variant returns, per layer, a kept-token index set per head (same count in every head)
and the decoded K/V of those rows. Diagnostic variants marked ``oracle`` use the planted
answer's position: they tell which part of the damage matters, they are not recipes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kdnctl.kernels.quant import reference as ref  # noqa: E402
from kdnctl.quant import transforms as tf  # noqa: E402
from kdnctl.quant import layer_kv


def fq(x: torch.Tensor, fmt: str, g: int, layout: str) -> torch.Tensor:
    """Fake-quantize [H, T, D] with the reference kernels (fp16 scale/zero)."""
    if fmt == "fp16":
        return x.half().float()
    if fmt == "bin":
        return fq_bin(x, g, layout)
    q, s, z = ref.quantize(x.contiguous(), fmt, g, layout)
    return ref.dequantize(q, s, z, fmt, g, layout, tuple(x.shape))


def fq_bin(x: torch.Tensor, g: int, layout: str) -> torch.Tensor:
    """1 bit: per group, code = x > mean; levels = the fp16 means of each side."""
    y = x.transpose(1, 2) if layout == "channel" else x  # [H, B, N]
    h, b, n = y.shape
    ng = math.ceil(n / g)
    pad = ng * g - n
    if pad:
        y = torch.cat([y, y[..., -1:].expand(h, b, pad)], -1)
    gr = y.reshape(h, b, ng, g)
    m = gr.mean(-1, keepdim=True)
    hi = gr > m
    cnt_hi = hi.sum(-1, keepdim=True).clamp_min(1)
    cnt_lo = (~hi).sum(-1, keepdim=True).clamp_min(1)
    v_hi = (gr * hi).sum(-1, keepdim=True) / cnt_hi
    v_lo = (gr * ~hi).sum(-1, keepdim=True) / cnt_lo
    v_hi, v_lo = v_hi.half().float(), v_lo.half().float()
    out = torch.where(hi, v_hi, v_lo).reshape(h, b, ng * g)[..., :n]
    return (out.transpose(1, 2) if layout == "channel" else out).contiguous()


KEPT: list = []
BITS = {"fp16": 16, "int8": 8, "int4": 4, "int3": 3, "int2": 2, "bin": 1}


def row_bytes(fmt: str, g: int, d: int = 64) -> float:
    if fmt == "fp16":
        return 2 * d
    return d * BITS[fmt] / 8 + 4 * d / g


def quant_rows(k, v, pos, theta, kfmt, kg, vfmt, vg, vlayout="token"):
    """k, v [H, T, D] post-RoPE at positions pos [H, T]: keys pre-RoPE per channel, values
    Hadamard-rotated, fake-quantized, transforms undone."""
    ku = tf.unrope(k, pos, theta)
    kq = tf.rope(fq(ku, kfmt, kg, "channel"), pos, theta)
    vr = tf.rotate(v)
    vq = tf.rotate(fq(vr, vfmt, vg, vlayout))
    return kq, vq


def mixed_rows(k, v, pos, theta, tiers_mask_hi, hi, lo):
    """Rows where mask: tier hi=(fmt, g) else lo; each tier quantized over its own rows
    (flattened head-major into [1, N, D] as the ladder does)."""
    H, T, D = k.shape
    ku, vr = tf.unrope(k, pos, theta), tf.rotate(v)
    kout, vout = torch.empty_like(ku), torch.empty_like(vr)
    for m, (fmt, kg, vg) in ((tiers_mask_hi, hi), (~tiers_mask_hi, lo)):
        if not bool(m.any()):
            continue
        if fmt == "drop":
            kout[m] = 0
            vout[m] = 0
            continue
        kout[m] = fq(ku[m][None], fmt, kg, "channel")[0]
        vout[m] = fq(vr[m][None], fmt, vg, "token")[0]
    return tf.rope(kout, pos, theta), tf.rotate(vout)


def probe_options(ap, store: str, kinds: str, limit: int, variants: str) -> None:
    """The options every in-memory probe takes (what ``probe_setup`` reads)."""
    ap.add_argument("--store", default=store)
    ap.add_argument("--kinds", default=kinds)
    ap.add_argument("--limit", type=int, default=limit)
    ap.add_argument("--shard", default="0/1", help="I/N: every Nth task from the Ith")
    ap.add_argument("--variants", default=variants)


def read_probe_logs(paths: list[str]) -> dict[str, dict[str, dict]]:
    """``{variant: {task id: result}}`` from probe logs (lines ``TASK VARIANT: {json} (Ns)``)."""
    runs: dict[str, dict[str, dict]] = {}
    for p in paths:
        for line in open(p):
            if line.startswith("realtext") and ": {" in line:  # realtext/, realtext-multifact/, ...-continuation/
                head, _, rest = line.partition(": ")
                tid, var = head.split(" ")
                runs.setdefault(var, {})[tid] = json.loads(rest[: rest.rindex("}") + 1])
    return runs


def probe_setup(store_dir: str, kinds: str, limit: int, shard: str, task_set: str = "realtext"):
    """(model, store, this shard's tasks, prompt format) for an in-memory probe: the first
    ``limit`` tasks of each of ``kinds`` (comma-separated), every Nth from the Ith (``shard``
    "I/N"), their documents ingested into ``store_dir``."""
    from kdnctl.evaluation.tasks import ingest_tasks, load_tasks
    from kdnctl.models.load import load_model
    from kdnctl.ingest.prompting import PromptFormat
    from kdnctl.store import Store

    i, n = (int(x) for x in shard.split("/"))
    tasks = load_tasks(task_set, kinds=kinds.split(","), limit=limit)[i::n]
    lm = load_model()
    store = Store(Path(store_dir), create=True)
    ingest_tasks(lm, store, tasks)
    return lm, store, tasks, PromptFormat.for_tokenizer(lm.tokenizer)


def full_cache(store, doc_id: str):
    """(bundles, keys [L x [H, T, D]], values, token ids) of a document's stored ``full`` version, fp32."""
    from kdnctl.format.bundle import decode_bundle

    ver = store.get_version(doc_id, "full")
    bundles = [decode_bundle(store.read_object(c.object)) for c in ver.chunks]
    n_layers = bundles[0].n_layers
    dense = [[layer_kv(b, i) for i in range(n_layers)] for b in bundles]
    keys = [torch.cat([d[i][0] for d in dense], 1).float() for i in range(n_layers)]
    values = [torch.cat([d[i][1] for d in dense], 1).float() for i in range(n_layers)]
    return bundles, keys, values, [int(t) for b in bundles for t in b.token_ids.tolist()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=str(ROOT / ".bench-quality"))
    ap.add_argument("--kinds", default="needle")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--variants", default="full")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from bench.quality import cache_reconstruct_scores
    from kdnctl.compress.stages.score import cat_stats as _cat_stats
    from kdnctl.engine.hf import LoadedContext
    from kdnctl.evaluation.tasks import load_tasks, run_task
    from kdnctl.models.load import load_model
    from kdnctl.ingest.prompting import PromptFormat
    from kdnctl.scorers import compute_importance
    from kdnctl.store import Store

    tasks = load_tasks("realtext", kinds=args.kinds.split(","), limit=args.limit + args.skip)[args.skip:]
    lm = load_model()
    store = Store(Path(args.store))
    cache_reconstruct_scores(Path(args.store) / "bench-cache" / "reconstruct")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    variants = args.variants.split(",")
    res: dict[str, list] = {v: [] for v in variants}
    for task in tasks:
        bundles, keys, values, token_ids = full_cache(store, task.id)
        L = len(keys)
        H, T, D = keys[0].shape
        header = int(bundles[0].meta.get("header_tokens", 0))
        rope = bundles[0].meta["model"].get("rope") or {}
        theta = float(rope.get("rope_theta"))
        stats = _cat_stats(bundles)
        imp = compute_importance("hybrid", stats, lm=lm, keys=keys, values=values, token_ids=token_ids,
                                 n_layers=L, n_heads=H)
        surpr = stats["surprisal"].float().reshape(-1)[:T]
        pos = torch.arange(T).expand(H, T)
        TOKS[:] = [lm.tokenizer.decode([t]) for t in token_ids]
        # oracle: the answer digits' token span (diagnostic only)
        ans = lm.tokenizer(task.answer, add_special_tokens=False).input_ids if task.answer else []
        span = None
        for s in range(T - len(ans) + 1):
            if ans and token_ids[s:s + len(ans)] == ans:
                span = (s, s + len(ans))
        for var in variants:
            t0 = time.perf_counter()
            ks, vs, nbytes = build(var, keys, values, pos, theta, imp, surpr, header, span, T)
            ctx = LoadedContext(keys=[k[None] for k in ks], values=[v[None] for v in vs], next_position=T,
                                token_ids=token_ids, label=var, doc_id=task.id)
            r = run_task(lm, ctx, task, fmt, 24)
            r["frac"] = round(nbytes / (2 * 2 * L * H * D * T), 4)
            if KEPT:
                r["span_kept"] = round(sum(KEPT) / len(KEPT), 3)
            KEPT.clear()
            if KLT_LOG:
                for role in ("k", "v"):
                    e = [x[3] for x in KLT_LOG if x[0][1] == role]
                    a = [x[2] for x in KLT_LOG if x[0][1] == role]
                    r[f"{role}_err"], r[f"{role}_active"] = round(sum(e) / len(e), 4), round(sum(a) / len(a), 1)
                KLT_LOG.clear()
            res[var].append(r)
            print(f"{task.id} {var}: {json.dumps(r)} ({time.perf_counter() - t0:.1f}s)", flush=True)
    print("\nsummary (n tasks each):")
    for v, rs in res.items():
        c = [r for r in rs if "correct" in r]
        cn = [r for r in rs if "correct" not in r]
        msg = f"{v:40s} frac {sum(r['frac'] for r in rs) / len(rs):.3f}"
        if c:
            msg += f" correct {sum(r['correct'] for r in c)}/{len(c)} answer_nll {sum(r['nll'] for r in c) / len(c):.3f}"
        sk = [r["span_kept"] for r in rs if "span_kept" in r]
        if sk:
            msg += f" span_kept {sum(sk) / len(sk):.3f}"
        if cn:
            msg += f" cont_nll {sum(r['nll'] for r in cn) / len(cn):.4f} ({len(cn)})"
        print(msg)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


TOKS: list = []


def seg_scores(surpr: torch.Tensor, toks: list[str], how: str) -> torch.Tensor:
    """Every token gets its segment's score; segments end at a newline or a sentence end."""
    T = surpr.shape[0]
    out = torch.zeros(T)
    start = 0
    for j in range(T):
        t = toks[j]
        if "\n" in t or t.rstrip().endswith((".", "?", "!")) or j == T - 1:
            seg = surpr[start:j + 1]
            if how == "segmean":
                v = seg.mean()
            elif how == "segmax":
                v = seg.max()
            elif how == "segtop3":
                v = seg.topk(min(3, len(seg))).values.mean()
            else:  # segsum
                v = seg.sum()
            out[start:j + 1] = v
            start = j + 1
    return out


BASES: dict = {}
KLT_LOG: list = []


def code_rate(y: torch.Tensor, step: float) -> tuple[torch.Tensor, float]:
    """Uniform mid-tread quantizer of y [T, C] with one step; (codes, order-0 entropy in bits
    summed over channels, each channel its own model)."""
    q = torch.round(y / step).clamp(-127, 127).long()
    counts = torch.zeros(y.shape[1], 255, dtype=torch.float64)
    counts.scatter_add_(1, (q + 127).T, torch.ones_like(q.T, dtype=torch.float64))
    p = counts / y.shape[0]
    h = -(p * torch.log2(p.clamp_min(1e-300))).sum(1)
    return q, float(h.sum()) * y.shape[0]


def mixed_rate(y, fr, step, fine):
    """Rows in fr coded with step/fine, the rest with step; each set its own per-channel model."""
    q = torch.zeros_like(y, dtype=torch.long)
    rate = 0.0
    for m, st in ((fr, step / fine), (~fr, step)):
        if bool(m.any()):
            qm, r = code_rate(y[m], st)
            q[m] = qm
            rate += r
    return q, rate


def klt_code(x: torch.Tensor, bits: float, header: int, key, basis: str, fine_rows=None, fine=1.0):
    """x [H, T, D]: header rows fp16; the rest centred, rotated into its principal axes (a
    per-document basis, or the previous document's with basis=prev), one uniform step per
    head chosen by bisection so the entropy-coded rate is ``bits`` per element (the basis and
    mean in fp16 counted); returns (reconstruction, bytes)."""
    H, T, D = x.shape
    hd = max(1, header)
    out = x.clone()
    nbytes = H * hd * D * 2
    for h in range(H):
        xr = x[h, hd:].double()
        n = xr.shape[0]
        if n == 0:
            continue
        mu = xr.mean(0)
        c = xr - mu
        vecs = torch.linalg.eigh(c.T @ c / n)[1].flip(1)
        if basis == "eye":  # no rotation: per-channel steps, no basis to store
            vecs = torch.eye(D, dtype=torch.float64)
        if basis == "prev":  # the previous document's axes: what a shared per-model basis would give
            vecs, BASES[(key, h)] = BASES.get((key, h), vecs), vecs
        y = (xr - mu) @ vecs
        fr = fine_rows[hd:] if fine_rows is not None else torch.zeros(n, dtype=torch.bool)
        target = bits * n * D
        lo, hi = math.log(1e-4 * y.abs().max().item() + 1e-12), math.log(4 * y.abs().max().item() + 1e-9)
        for _ in range(30):
            mid = 0.5 * (lo + hi)
            q, rate = mixed_rate(y, fr, math.exp(mid), fine)
            active = int((q != 0).any(0).sum())
            side = (active * D * 2 * (basis not in ("prev", "eye")) + D * 2 + active * 2) * 8
            if rate + side > target:
                lo = mid
            else:
                hi = mid
        step = math.exp(hi)
        q, rate = mixed_rate(y, fr, step, fine)
        active = int((q != 0).any(0).sum())
        side = (active * D * 2 * (basis not in ("prev", "eye")) + D * 2 + active * 2) * 8
        steps = torch.where(fr, step / fine, step).double()[:, None]
        out[h, hd:] = ((q.double() * steps) @ vecs.T + mu).float()
        nbytes += (rate + side) / 8
        err = float(((out[h, hd:] - x[h, hd:]) ** 2).sum() / (x[h, hd:] ** 2).sum())
        KLT_LOG.append((key, h, active, err))
    return out, nbytes


def topk_rows(score: torch.Tensor, k: int) -> torch.Tensor:
    """[H, T] score -> [H, k] indices sorted ascending."""
    return score.topk(k, dim=-1).indices.sort(-1).values


def build(var: str, keys, values, pos, theta, imp, surpr, header, span, T):
    """variant name -> (keys, values, estimated stored bytes)."""
    L = len(keys)
    H, _, D = keys[0].shape
    p = dict(kv.split("=") for kv in var.split(":")[1:])
    name = var.split(":")[0]
    ks, vs, nbytes = [], [], 0.0
    for i in range(L):
        k, v = keys[i], values[i]
        if name == "full":
            ks.append(k); vs.append(v); nbytes += 2 * H * T * 2 * D
            continue
        if name == "uni":  # uni:k=int2:kg=32:v=int2:vg=32
            kq, vq = quant_rows(k, v, pos, theta, p["k"], int(p["kg"]), p["v"], int(p["vg"]))
            ks.append(kq); vs.append(vq)
            nbytes += H * T * (row_bytes(p["k"], int(p["kg"])) + row_bytes(p["v"], int(p["vg"])))
            continue
        if name in ("evict", "evictmix"):
            # evict:keep=0.44:k=int2:kg=32:v=int2:vg=32[:score=hybrid|surpr|oracle][:tail=64][:win=0]
            keep = float(p["keep"])
            score = imp[i].clone()
            if p.get("score") == "surpr":
                score = surpr.expand(H, T).clone()
            if p.get("score") == "spread":  # surprisal max over a +-w window (whole planted sentence)
                w = int(p.get("w", 8))
                s = torch.nn.functional.max_pool1d(surpr[None, None], 2 * w + 1, 1, w)[0, 0]
                score = s.expand(H, T).clone() + 0.001 * imp[i]
            if p.get("score") == "mixsp":  # rank mix of hybrid and spread surprisal
                w = int(p.get("w", 8))
                s = torch.nn.functional.max_pool1d(surpr[None, None], 2 * w + 1, 1, w)[0, 0]
                r = s.argsort().argsort().float() / T
                score = 0.5 * r.expand(H, T) + 0.5 * (imp[i].argsort(-1).argsort(-1).float() / T)
            if p.get("score", "").startswith("seg"):
                s = seg_scores(surpr, TOKS, p["score"])
                score = s.expand(H, T).clone() + 1e-3 * imp[i]
                if p.get("mixw"):
                    a = float(p["mixw"])
                    rk = lambda x: x.argsort(-1).argsort(-1).float() / T  # noqa: E731
                    score = a * rk(s.expand(H, T)) + (1 - a) * rk(imp[i])
            big = score.max() + 10
            score[:, :header] = big
            tail = int(p.get("tail", 64))
            if tail:
                score[:, -tail:] = big
            if p.get("oracle") and span:
                score[:, max(0, span[0] - 12):span[1] + 2] = big + 1
            n = max(1, round(keep * T))
            idx = topk_rows(score, n)
            if span:
                sp = torch.arange(span[0], span[1])
                KEPT.append(float(torch.isin(idx, sp).sum()) / (H * len(sp)))
            kk, vv = k.gather(1, idx[..., None].expand(-1, -1, D)), v.gather(1, idx[..., None].expand(-1, -1, D))
            pp = idx
            if name == "evict":
                kq, vq = quant_rows(kk, vv, pp, theta, p["k"], int(p["kg"]), p["v"], int(p["vg"]))
                nbytes += H * n * (row_bytes(p["k"], int(p["kg"])) + row_bytes(p["v"], int(p["vg"])) + 2)
            else:  # evictmix: top `hi` fraction of kept at hi tier
                hi_frac = float(p["hi"])
                sc = score.gather(1, idx)
                nh = round(hi_frac * n)
                m = torch.zeros(H, n, dtype=torch.bool)
                if nh:
                    m.scatter_(1, sc.topk(nh, -1).indices, True)
                hi_t = (p["hk"], int(p["hkg"]), int(p["hvg"]))
                lo_t = (p["k"], int(p["kg"]), int(p["vg"]))
                kq, vq = mixed_rows(kk, vv, pp, theta, m, hi_t, lo_t)
                nbytes += H * nh * 2 * row_bytes(p["hk"], int(p["hkg"])) + H * (n - nh) * 2 * row_bytes(p["k"], int(p["kg"])) + H * n * 3
            ks.append(kq); vs.append(vq)
            continue
        if name == "klt":  # klt:kb=1.0:vb=1.6[:basis=doc|prev][:sel=0.25:fine=4]
            fine_rows = None
            if p.get("sel"):
                s = seg_scores(surpr, TOKS, "segmean")
                s[:header] = s.max() + 1
                s[-int(p.get("tail", 64)):] = s.max() + 1
                fine_rows = torch.zeros(T, dtype=torch.bool)
                fine_rows[s.topk(round(float(p["sel"]) * T)).indices] = True
            fine = float(p.get("fine", 1))
            kq, b1 = klt_code(tf.unrope(k, pos, theta), float(p["kb"]), header, (i, "k"), p.get("basis", "doc"),
                              fine_rows, fine)
            vq, b2 = klt_code(v, float(p["vb"]), header, (i, "v"), p.get("basis", "doc"), fine_rows, fine)
            ks.append(tf.rope(kq, pos, theta)); vs.append(vq); nbytes += b1 + b2
            continue
        raise SystemExit(f"unknown variant {var}")
    return ks, vs, nbytes


if __name__ == "__main__":
    main()
