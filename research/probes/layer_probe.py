"""Do layers and roles differ in how much an ec quantization error costs? One run, real tasks.

    python bench/layer_probe.py [--limit 6] [--budget 0.25]

For each multi-fact task: the context's cache is quantized as ``ec`` does (per-channel steps
from ``kdnctl.quant.sensitivity``, keys before RoPE, every head at the same relative weighted
error, one scale ``alpha`` fitted to the byte budget; no token levels), one layer and role at a
time, and the KL divergence of the model's next-token distributions from the clean cache's is
measured on a query-agnostic probe (KVzip's task: repeat the document's first tokens after
``REPEAT_PROMPT``). If the sensitivities ``m`` differ, the steps ``step / sqrt(m / gmean(m))``
spend the same bits where they cost least (high-rate optimum of ``sum m_i * D_i``). Printed: the
spread of ``m``; then, at equal encoded bytes, the KL of the repeat probe and the question's
answer NLL for the uniform and the reweighted allocation (all layers quantized at once).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.allocate.rate import clamp_steps, fit_scale, relative_steps, step_floor  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import transforms as tf  # noqa: E402
from kdnctl.quant.entropy import EntropyQuantizer, dequantize_codes, encode_role, quantize_codes  # noqa: E402
from kdnctl.quant.sensitivity import key_weights, value_weights  # noqa: E402
from kdnctl.scorers.reconstruct import REPEAT_PROMPT  # noqa: E402

PROBE_TOKENS = 192


class Doc:
    def __init__(self, lm, task):
        self.lm = lm
        tok = lm.tokenizer
        self.ids = tok(task["text"]).input_ids
        model = lm.model
        cfg = model.config
        self.theta = float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"])
        with torch.no_grad():
            pkv = model(torch.tensor([self.ids]), use_cache=True).past_key_values
        self.k = [layer.keys[0].float() for layer in pkv.layers]
        self.v = [layer.values[0].float() for layer in pkv.layers]
        self.L, (self.H, self.T, self.D) = len(self.k), self.k[0].shape
        self.pos = torch.arange(self.T).expand(self.H, -1)
        q = EntropyQuantizer(key_rope_theta=self.theta)
        self.x = [q.forward(k, v, self.pos) for k, v in zip(self.k, self.v)]
        kw = key_weights(lm, self.ids, self.L, self.H, self.D)
        vw = value_weights(lm, self.L, self.H, self.D)
        self.base = [(relative_steps(k, kw[i]), relative_steps(v, vw[i])) for i, (k, v) in enumerate(self.x)]
        self.floor = [(step_floor(k, 0), step_floor(v, 0)) for k, v in self.x]
        self.levels = torch.zeros(self.T, dtype=torch.uint8)
        self.repeat = tok(REPEAT_PROMPT, add_special_tokens=False).input_ids + self.ids[:PROBE_TOKENS]
        self.repeat_all = tok(REPEAT_PROMPT, add_special_tokens=False).input_ids + self.ids
        self.questions = []  # every planted fact asked for: "The X is N." -> "What is the X?" N
        for sentence in task["planted"]:
            m = re.match(r"^The (.*) is (\S+)\.$", sentence)
            prompt = tok("\n\nQuestion: What is the " + m.group(1) + "?\nAnswer:", add_special_tokens=False).input_ids
            answer = tok(" " + m.group(2), add_special_tokens=False).input_ids
            self.questions.append((prompt + answer, answer))
        self.ref = {"short": self.logp(self.k, self.v, self.repeat), "all": self.logp(self.k, self.v, self.repeat_all)}

    def steps(self, alpha, i, mult):
        return tuple(clamp_steps(alpha * b * m, f) for b, f, m in zip(self.base[i], self.floor[i], mult[i]))

    def nbytes(self, alpha, mult):
        return sum(encode_role(x, s, self.levels)[0].numel() for i in range(self.L)
                   for x, s in zip(self.x[i], self.steps(alpha, i, mult)))

    def noisy(self, alpha, mult, only=None):
        ks, vs = list(self.k), list(self.v)
        for i in range(self.L):
            for r, (x, s) in enumerate(zip(self.x[i], self.steps(alpha, i, mult))):
                if only is not None and only != (i, r):
                    continue
                s = s.half().float()
                mean = x.mean(1).half().float()
                y = dequantize_codes(quantize_codes(x, s, mean, self.levels), s, mean, self.levels)
                if r == 0:
                    ks[i] = tf.rope(y, self.pos, self.theta)
                else:
                    vs[i] = y
        return ks, vs

    def logp(self, ks, vs, seq):
        from transformers import DynamicCache
        cache = DynamicCache(config=self.lm.model.config)
        for i, (k, v) in enumerate(zip(ks, vs)):
            cache.update(k[None].to(self.lm.dtype), v[None].to(self.lm.dtype), i)
        with torch.no_grad():
            out = self.lm.model(torch.tensor([seq]), past_key_values=cache, use_cache=True,
                                position_ids=torch.arange(self.T, self.T + len(seq))[None]).logits[0]
        return torch.log_softmax(out.float(), -1)

    def kl(self, ks, vs, probe="short"):
        ref = self.ref[probe]
        lp = self.logp(ks, vs, self.repeat if probe == "short" else self.repeat_all)
        return float((ref.exp() * (ref - lp)).sum(-1).mean())

    def answer_nll(self, ks, vs):
        out = []
        for seq, answer in self.questions:
            lp = self.logp(ks, vs, seq)
            n = len(answer)
            out.append(float(-lp[-n - 1:-1].gather(1, torch.tensor(answer)[:, None]).mean()))
        return sum(out) / len(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--budget", type=float, default=0.25)
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model()
    tasks = [json.loads(line) for line in open(ROOT / "examples/eval/realtext-multifact.jsonl")][:args.limit]
    variants = [("short", 0.5, 8.0), ("short", 0.25, 4.0), ("all", 0.5, 8.0), ("all", 0.25, 4.0)]
    logms = {"short": [], "all": []}
    rows = []
    for task in tasks:
        doc = Doc(lm, task)
        one = [(torch.ones(()), torch.ones(()))] * doc.L
        cap = args.budget * 4 * doc.L * doc.H * doc.T * doc.D * 0.92  # codes only: ~8% goes to params/headers
        alpha = fit_scale(lambda a: doc.nbytes(a, one), cap, tol=0.01)
        ms = {}
        for probe in logms:
            m = torch.tensor([[doc.kl(*doc.noisy(alpha, one, (i, r)), probe) for r in range(2)] for i in range(doc.L)])
            ms[probe] = m.clamp_min(1e-7)
            logms[probe].append(ms[probe].log())
        full = doc.answer_nll(doc.k, doc.v)
        row = [doc.answer_nll(*doc.noisy(alpha, one)) - full]
        print(f"{task['id']} T={doc.T} alpha={alpha:.3f} answers NLL full {full:.3f} uniform {row[0]:+.4f}", flush=True)
        for probe, p, clip in variants:
            m = ms[probe]
            g = m.log().mean().exp()
            mult_t = (g / m).pow(p).clamp(1 / clip, clip)
            mult = [(mult_t[i, 0], mult_t[i, 1]) for i in range(doc.L)]
            a2 = fit_scale(lambda a: doc.nbytes(a, mult), cap, tol=0.01)
            row.append(doc.answer_nll(*doc.noisy(a2, mult)) - full)
            print(f"   {probe} p={p} clip={clip}: bytes {doc.nbytes(a2, mult) / doc.nbytes(alpha, one):.3f}x "
                  f"repeat KL {doc.kl(*doc.noisy(alpha, one), probe):.4f} -> {doc.kl(*doc.noisy(a2, mult), probe):.4f}; "
                  f"answers dNLL {row[-1]:+.4f}", flush=True)
        rows.append(row)
    for probe, lst in logms.items():
        flat = torch.stack(lst).flatten(1)
        if len(lst) > 1:
            c = torch.corrcoef(flat)
            print(f"{probe}: log-sensitivity correlation between documents {float(c[~torch.eye(len(c), dtype=bool)].mean()):.2f}")
    c = torch.corrcoef(torch.stack([torch.stack(logms["short"]).flatten(), torch.stack(logms["all"]).flatten()]))
    print(f"short vs all probe: correlation {float(c[0, 1]):.2f}")
    print("mean log10 m per layer (short keys, values; all keys, values):")
    a, b = torch.stack(logms["short"]).mean(0) / math.log(10), torch.stack(logms["all"]).mean(0) / math.log(10)
    for i in range(a.shape[0]):
        print(f"  {i:2d} {float(a[i, 0]):6.2f} {float(a[i, 1]):6.2f} {float(b[i, 0]):6.2f} {float(b[i, 1]):6.2f}")
    r = torch.tensor(rows)
    names = ["uniform"] + [f"{p} p={e} clip={c}" for p, e, c in variants]
    print(f"mean answers dNLL over {len(rows)} documents: " + "; ".join(f"{n} {float(x):+.4f}" for n, x in zip(names, r.mean(0))))


if __name__ == "__main__":
    main()
