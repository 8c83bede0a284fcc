"""Measure every model of the test matrix (tests/test_models.py) and write docs/models.md's table.

Each model is a tiny random one built from transformers' config classes (3 layers, hidden 128,
the default model's tokenizer); tests/fixtures/models_doc.md (535 tokens) is ingested, loaded and compared with
transformers' own forward, then compressed with the defaults at 0.25 and 0.083 and loaded again;
the default model (SmolLM2, real weights) runs the same steps as the row to compare with.
One run, nothing downloaded:

    python scripts/models_table.py            # rewrites the table in docs/models.md
    python scripts/models_table.py --print    # prints it only
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

BEGIN, END = "<!-- table: scripts/models_table.py -->", "<!-- end of table -->"


def measure() -> list[str]:
    import torch

    import test_models as tm
    from conftest import default_lm, run_cli
    from kdnctl.models.load import load_model, use_loaded_models

    torch.set_num_threads(1)
    tok = default_lm().tokenizer
    rows = [tm.TABLE_HEAD[:-1] + " stored full vs transformers (max abs logit diff) | 0.25: TV to full, size "
            "| 0.083: TV to full, size |",
            "|" + "---|" * 10]
    with tempfile.TemporaryDirectory() as tmp:
        for name in tm.MODELS:
            work = Path(tmp) / name
            path = tm.build_model_dir(name, work / "model", tok)
            mlm = load_model(path)
            store = work / "s"
            with use_loaded_models(mlm):
                run_cli("ingest", tm.DOC, "--model", path, store=store, check=True)
            gap = tm.identity_gap(mlm, store)
            cells = []
            for budget in ("0.25", "0.083"):
                tv, frac = tm.compressed_distance(mlm, path, store, budget)
                cells.append(f"{tv:.4f}, {frac:.1%} of fp16")
            rows.append(f"{tm.support_row(name, mlm)} {gap:.1e} | {cells[0]} | {cells[1]} |")
            print(rows[-1], file=sys.stderr)
        # the default model (real weights) on the same document: the distances to compare with
        lm = default_lm()
        store = Path(tmp) / "default"
        run_cli("ingest", tm.DOC, store=store, check=True)
        gap = tm.identity_gap(lm, store)
        cells = []
        for budget in ("0.25", "0.083"):
            tv, frac = tm.compressed_distance(lm, lm.source, store, budget)
            cells.append(f"{tv:.4f}, {frac:.1%} of fp16")
        rows.append(f"| SmolLM2-135M-Instruct (the default model, real weights) | {type(lm.model).__name__} | separate "
                    f"| full x {lm.n_layers} | - | default | {lm.summary['n_kv_heads']} x {lm.summary['head_dim']} | "
                    f"{gap:.1e} | {cells[0]} | {cells[1]} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--print", action="store_true", help="print the table, do not write docs/models.md")
    args = ap.parse_args()
    table = "\n".join(measure())
    if args.print:
        print(table)
        return
    doc = REPO / "docs" / "models.md"
    text = doc.read_text()
    new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _m: f"{BEGIN}\n{table}\n{END}", text, flags=re.S)
    doc.write_text(new)
    print(f"wrote {doc}", file=sys.stderr)


if __name__ == "__main__":
    main()
