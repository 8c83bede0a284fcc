"""Would a query-agnostic gradient single out the planted facts? One run, real multi-fact tasks.

    python bench/fisher_probe.py [--limit 8]

For each task of ``examples/eval/realtext-multifact.jsonl``: the context's cache (one forward
pass) becomes leaf tensors, the model repeats the context after ``kdnctl.scorers.reconstruct.REPEAT_PROMPT``
over that cache (KVzip's reconstruction task: reproducing the text needs every number), and the
teacher-forced NLL of the repetition is back-propagated to the cached K/V. A token's
sensitivity is the squared gradient summed over its keys and values in every layer and KV head
(the diagonal Fisher information of the cache under that task: the weight an error in that row
would get). Printed per task: where the planted numbers' tokens rank (0 = most sensitive), the
share of the planted facts' tokens in the top quarter, and how concentrated the mass is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.scorers.reconstruct import REPEAT_PROMPT  # noqa: E402


def sensitivity(lm, ids: list[int]) -> tuple[torch.Tensor, float, float]:
    """Per-token squared gradient of the repetition NLL w.r.t. the cached K/V; NLL per token;
    the keys' share of the total."""
    from transformers import DynamicCache

    model = lm.model
    with torch.no_grad():
        pkv = model(torch.tensor([ids]), use_cache=True).past_key_values
    keys = [layer.keys.detach().clone().requires_grad_(True) for layer in pkv.layers]
    values = [layer.values.detach().clone().requires_grad_(True) for layer in pkv.layers]
    cache = DynamicCache(config=model.config)
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, i)
    prompt = lm.tokenizer(REPEAT_PROMPT, add_special_tokens=False).input_ids
    seq = prompt + ids
    t = len(ids)
    logits = model(torch.tensor([seq]), past_key_values=cache, use_cache=True,
                   position_ids=torch.arange(t, t + len(seq))[None]).logits[0]
    logp = torch.log_softmax(logits[len(prompt) - 1:-1].float(), -1)
    loss = -logp[torch.arange(t), torch.tensor(ids)].sum()
    loss.backward()
    gk = torch.stack([k.grad[0].pow(2).sum((0, 2)) for k in keys]).sum(0)
    gv = torch.stack([v.grad[0].pow(2).sum((0, 2)) for v in values]).sum(0)
    return gk + gv, float(loss.detach()) / t, float(gk.sum() / (gk.sum() + gv.sum()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_model()
    tasks = [json.loads(line) for line in open(ROOT / "examples/eval/realtext-multifact.jsonl")][:args.limit]
    print("| task | tokens | repeat NLL/token | planted digits: mean rank | in top 10% | in top 25% "
          "| fact tokens in top 25% | top 1% of tokens: share | keys' share |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for task in tasks:
        text = task["text"]
        enc = lm.tokenizer(text, return_offsets_mapping=True)
        spans = [(text.index(p), text.index(p) + len(p)) for p in task["planted"]]
        in_fact = torch.tensor([any(a <= o[0] < b for a, b in spans) for o in enc["offset_mapping"]])
        digit = in_fact & torch.tensor([text[o[0]:o[1]].strip().isdigit() for o in enc["offset_mapping"]])
        s, nll, key_share = sensitivity(lm, enc["input_ids"])
        t = s.numel()
        rank = s.argsort(descending=True).argsort().float() / t
        top1 = float(s.sort(descending=True).values[:max(t // 100, 1)].sum() / s.sum())
        print(f"| {task['id']} | {t} | {nll:.3f} | {float(rank[digit].mean()):.2f} | "
              f"{float((rank[digit] < 0.1).float().mean()):.2f} | {float((rank[digit] < 0.25).float().mean()):.2f} | "
              f"{float((rank[in_fact] < 0.25).float().mean()):.2f} | {top1:.2f} | {key_share:.2f} |")


if __name__ == "__main__":
    main()
