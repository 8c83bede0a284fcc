"""Calibrate a model's key basis for ``kdnctl compress --option key_basis=model`` (kdnctl/quant/basis.py).

    python scripts/calibrate_key_basis.py [--model M] [--docs 16] [--max-tokens 1500] [--out kdnctl/bases | --store DIR]

Real text the project did not write: rendered man pages (``/usr/share/man``), none of a command
family that the evaluation sets (``examples/eval/*.jsonl``) draw from, so the basis never saw an
evaluated document. The keys of each page (one forward pass) are step-normalised as ``ec`` codes
them, their covariance summed, and its eigenvectors (float32) registered for the model's
fingerprint in ``--out`` (``kdnctl/bases/`` ships with the package; point ``$KDNCTL_KEY_BASES``
at another directory for your own models), or with ``--store`` into a store as that model's basis
(what ``kdnctl compress`` otherwise calibrates on the store's own documents the first time it
compresses for a model without one; kdnctl/quant/store_basis.py). The same pages give the same file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kdnctl.evaluation.realtext import find_pages, page_family  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.format.key_basis import PACKAGE_DIR, register  # noqa: E402
from kdnctl.quant.basis import calibrate, key_samples  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--man-root", default="/usr/share/man")
    ap.add_argument("--out", default=str(PACKAGE_DIR))
    ap.add_argument("--store", default=None, help="record the basis in this store instead of --out")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    lm = load_model(args.model)
    evaluated = frozenset(page_family(json.loads(line)["source"])
                          for f in sorted((ROOT / "examples/eval").glob("*.jsonl")) for line in open(f)
                          if json.loads(line).get("source"))
    tok = lm.tokenizer
    pages = find_pages(Path(args.man_root), rng=random.Random(args.seed), want=args.docs, min_chars=4000,
                       count_tokens=lambda t: len(tok(t)["input_ids"]), min_tokens=512, skip_families=evaluated)
    if not pages:
        sys.exit(f"no man pages found under {args.man_root}")
    ids = [tok(p.text)["input_ids"][: args.max_tokens] for p in pages]
    if args.store:
        from kdnctl.quant.store_basis import calibrate_into_store
        from kdnctl.store import Store

        with Store(args.store) as st:
            sha = calibrate_into_store(st, lm, ids, source=f"calibrated on {len(pages)} man pages")
        print(f"key basis {sha} recorded for {lm.fingerprint[:16]} in store {args.store}")
        return
    basis = calibrate(key_samples(lm, ids))
    sha = register(basis, lm.fingerprint, Path(args.out))
    print(f"{len(pages)} pages ({sum(map(len, ids))} tokens; {len(evaluated)} evaluated command families skipped): "
          f"{', '.join(p.source for p in pages)}")
    print(f"key basis {sha} {list(basis.shape)} registered for {lm.fingerprint[:16]} in {args.out}")


if __name__ == "__main__":
    main()
