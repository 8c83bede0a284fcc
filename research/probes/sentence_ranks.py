"""Where do offline scores put the planted answers? For needle and multi-fact tasks already in a
bench store (``bench/quality.py`` ingests them), the fraction of the answer's tokens that each
token ranking keeps at ``--keep``, and the rank of the planted sentences among the document's
sentences by mean surprisal (``kdnctl.scorers.sentences``). No model forward: surprisal is read
from the stored ingest statistics (``--reconstruct`` adds the offline reconstruction scorer,
cached like ``bench/quality.py`` does).

    python bench/sentence_ranks.py --store .bench-quality --limit 11 [--keep 0.25] [--reconstruct] [--local 64,128]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from kdnctl.quant import layer_kv

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=str(ROOT / ".bench-quality"))
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--keep", type=float, default=0.25)
    ap.add_argument("--reconstruct", action="store_true")
    ap.add_argument("--local", type=lambda v: [int(x) for x in v.split(",")], default=[],
                    help="windows W of the sentences-local scorer to compare, e.g. 64,128")
    ap.add_argument("--isolated", action="store_true", help="also: each sentence's mean surprisal with no document "
                    "before it (one batched forward over the sentences)")
    args = ap.parse_args()

    import torch

    from kdnctl.format.bundle import decode_bundle
    from kdnctl.compress.stages.score import cat_stats as _cat_stats
    from kdnctl.errors import NotFoundError
    from kdnctl.evaluation.tasks import load_tasks
    from kdnctl.models.load import load_model
    from kdnctl.scorers.rank import rank01 as _rank01
    from kdnctl.scorers import compute_importance
    from kdnctl.scorers.sentences import local_sentence_scores, sentence_bounds, sentence_surprisal, token_texts
    from kdnctl.store import Store

    torch.set_num_threads(1)
    lm = load_model(device="cpu", dtype="float32")
    store = Store(Path(args.store))
    if args.reconstruct:
        from bench.quality import cache_reconstruct_scores

        cache_reconstruct_scores(Path(args.store) / "bench-cache" / "reconstruct")
    cover: dict[tuple[str, str], list[float]] = {}
    for task in load_tasks("realtext", kinds=["needle", "multifact"], limit=args.limit):
        try:
            ver = store.get_version(task.id, "full")
        except NotFoundError:
            continue
        bundles = [decode_bundle(store.read_object(c.object)) for c in ver.chunks]
        stats = _cat_stats(bundles)
        ids = [int(t) for b in bundles for t in b.token_ids.tolist()]
        t = len(ids)
        texts = token_texts(lm.tokenizer, ids)
        s = stats["surprisal"].float().reshape(-1)
        scores = {"token surprisal": s, "sentence mean surprisal": sentence_surprisal(s, texts)}
        for w in args.local:
            scores[f"sentences-local W={w}"] = local_sentence_scores(lm, s, ids, window=w)
        if args.reconstruct:
            n_layers = bundles[0].n_layers
            dense = [[layer_kv(b, i) for i in range(n_layers)] for b in bundles]
            keys = [torch.cat([d[i][0] for d in dense], 1).float() for i in range(n_layers)]
            values = [torch.cat([d[i][1] for d in dense], 1).float() for i in range(n_layers)]
            rec = compute_importance("reconstruct", stats, lm=lm, keys=keys, values=values, token_ids=ids,
                                     n_layers=n_layers, n_heads=keys[0].shape[0])
            scores["reconstruct (mean rank over heads)"] = _rank01(rec).mean((0, 1))
        if args.isolated:
            iso = isolated_sentence_surprisal(lm, ids, sentence_bounds(texts))
            scores["isolated sentence mean surprisal"] = iso
            both = torch.maximum(_rank01(iso[None])[0], _rank01(scores["sentence mean surprisal"][None])[0])
            scores["max rank: sentence mean, isolated"] = both
        ans = lm.tokenizer(task.answer, add_special_tokens=False).input_ids
        starts = [i for i in range(t - len(ans) + 1) if ids[i:i + len(ans)] == ans]
        if not starts:
            continue
        span = range(starts[-1], starts[-1] + len(ans))
        k = round(args.keep * t)
        for name, sc in scores.items():
            top = set(sc.topk(k).indices.tolist())
            cover.setdefault((task.kind, name), []).append(sum(i in top for i in span) / len(ans))
        if task.kind == "multifact":
            bounds = sentence_bounds(texts)
            means = torch.tensor([float(s[a:b].mean()) for a, b in bounds])
            order = means.argsort(descending=True).argsort()
            facts = [(int(order[j]), "".join(texts[a:b]).strip()) for j, (a, b) in enumerate(bounds)
                     if any(v in "".join(texts[a:b]) for v in [task.answer, *task.distractors])]
            asked = [r for r, txt in facts if task.answer in txt]
            print(f"{task.id}: {len(bounds)} sentences; planted facts rank {sorted(r + 1 for r, _ in facts)}, "
                  f"the asked one {[r + 1 for r in asked]}")
    print(f"\nfraction of the answer's tokens in the top {args.keep:.0%} (mean over tasks):")
    for (kind, name), v in sorted(cover.items()):
        print(f"  {kind:<10} {name:<38} {sum(v) / len(v):.3f} (n={len(v)})")


def isolated_sentence_surprisal(lm, ids: list[int], bounds: list[tuple[int, int]]):
    """Per token: the mean -log p of its sentence's tokens (from the second on) with nothing
    before the sentence; one padded batch."""
    import torch

    out = torch.zeros(len(ids))
    segs = [(a, b) for a, b in bounds if b - a >= 2]
    n = max((b - a for a, b in segs), default=0)
    if not segs:
        return out
    x = torch.zeros(len(segs), n, dtype=torch.long)
    mask = torch.zeros(len(segs), n, dtype=torch.long)
    for r, (a, b) in enumerate(segs):
        x[r, :b - a] = torch.tensor(ids[a:b])
        mask[r, :b - a] = 1
    with torch.inference_mode():
        logits = lm.model(input_ids=x.to(lm.device), attention_mask=mask.to(lm.device)).logits.float().cpu()
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
    for r, (a, b) in enumerate(segs):
        out[a:b] = nll[r, :b - a - 1].mean()
    return out


if __name__ == "__main__":
    main()
