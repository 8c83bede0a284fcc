"""Sliding-window layers stored whole or by their window, on the windowed models of the test matrix
(tests/test_models.py: tiny random Mistral, Gemma2, Gemma3; the 535-token document, longer than
every window). One run, nothing downloaded; prints the table of docs/models.md's "by their window":

    python scripts/window_layers_table.py

Per model: ``--keep 1 --option window_layers=window`` (no quantization) against the stored full
version: stored bytes, tokens per layer, and the largest next-token logit difference against
transformers' own forward over the same tokens; then ``--budget 0.25`` and ``0.083`` with the
layers stored whole and by window: total variation distance of the next-token distribution
from the full version's, and stored bytes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

MODELS = ("mistral", "gemma2", "gemma3")


def main() -> None:
    import torch

    import test_models as tm
    from conftest import default_lm, run_cli
    from kdnctl.engine.hf import forward_suffix, load_document
    from kdnctl.models.load import load_model, use_loaded_models
    from kdnctl.store import Store

    torch.set_num_threads(1)
    tok = default_lm().tokenizer
    print("| model | layers | window, `--keep 1`: bytes vs full, tokens per layer | logits vs transformers | "
          "0.25 whole / window: TV to full | 0.083 whole / window: TV to full |")
    print("|" + "---|" * 6)
    with tempfile.TemporaryDirectory() as tmp:
        for name in MODELS:
            d = Path(tmp) / name
            path = tm.build_model_dir(name, d / "model", tok)
            mlm = load_model(path)
            store = d / "s"
            with use_loaded_models(mlm):
                run_cli("ingest", tm.DOC, "--model", path, store=store, check=True)
                run_cli("compress", tm.DOC.name, "--keep", "1", "--option", "window_layers=window", "--label", "win",
                        "--model", path, store=store, check=True)
                for b in ("0.25", "0.083"):
                    run_cli("compress", tm.DOC.name, "--budget", b, "--label", f"whole{b}", "--model", path,
                            store=store, check=True)
                    run_cli("compress", tm.DOC.name, "--budget", b, "--option", "window_layers=window",
                            "--label", f"window{b}", "--model", path, store=store, check=True)
            suffix = mlm.tokenizer(tm.SUFFIX, add_special_tokens=False).input_ids
            with Store(store, create=False) as st:
                def next_probs(label):
                    ctx = load_document(mlm, st, tm.DOC.name, label=label)
                    return ctx, forward_suffix(mlm, ctx, suffix, last_only=True)[0][-1]

                _, full = next_probs("full")
                ctx, win = next_probs("win")
                gap = (win - tm.own_forward_logits(mlm, ctx.token_ids + suffix)).abs().max().item()
                share = st.get_version(tm.DOC.name, "win").nbytes / st.get_version(tm.DOC.name, "full").nbytes
                tv = {}
                for label in ("whole0.25", "window0.25", "whole0.083", "window0.083"):
                    got = next_probs(label)[1]
                    tv[label] = 0.5 * (torch.softmax(got, -1) - torch.softmax(full, -1)).abs().sum().item()
                tokens = " / ".join(str(k.shape[2]) for k in ctx.keys)
                layers = tm.support_row(name, mlm).split(" | ")[3]
                print(f"| {tm._configs()[name][0]} | {layers} | {share:.1%}; {tokens} of {ctx.n_tokens} | {gap:.1e} | "
                      f"{tv['whole0.25']:.4f} / {tv['window0.25']:.4f} | {tv['whole0.083']:.4f} / "
                      f"{tv['window0.083']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
