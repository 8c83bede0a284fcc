"""The demo question's greedy answer per version, with the top two next tokens at each step.

    python bench/demo_margin.py [--store .kdn] [--versions full,ec-b0.25-p64,ec-b0.25-p64-even]

Run after scripts/demo.sh (and ``kdnctl compress --budget 0.25 --quant ec --protect 64 --layers
even`` for the even split): it shows where an answer is a near-tie in the full cache itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kdnctl.engine.hf import forward_suffix, load_document  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.store import Store  # noqa: E402

DOC, QUESTION = "zephyr-x200-manual.md", "How long does it take to charge the Zephyr X200 battery to 80 %?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--store", default=".kdn")
    ap.add_argument("--versions", default="full,ec-b0.25-p64,ec-b0.25-p64-even")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    lm, st = load_model(), Store(Path(args.store))
    tok = lm.tokenizer
    question = PromptFormat.for_tokenizer(tok).question_ids(tok, QUESTION)
    for label in args.versions.split(","):
        seq, steps = list(question), []
        for _ in range(args.tokens):
            logits = forward_suffix(lm, load_document(lm, st, DOC, label), seq, last_only=True)[0][-1]
            top = torch.softmax(logits.float(), -1).topk(2)
            seq.append(int(top.indices[0]))
            steps.append(f"{tok.decode([int(top.indices[0])])!r} {float(top.values[0]):.2f} / "
                         f"{tok.decode([int(top.indices[1])])!r} {float(top.values[1]):.2f}")
            if seq[-1] == tok.eos_token_id:
                break
        print(f"{label}: {tok.decode(seq[len(question):])!r}")
        print("   " + "\n   ".join(steps))


if __name__ == "__main__":
    main()
