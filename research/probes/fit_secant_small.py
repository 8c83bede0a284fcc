"""A first `b0.25` compress with the scale fit's default search against `--option fit=secant`,
on documents of the example corpus cut to a few sizes, against a bare prefill of the same tokens.

    python research/probes/fit_secant_small.py [1024,2048,4096]

For each size: the document ingested into its own store, the key basis and Fisher profile
recorded first (what a store's first compress measures once), then three compresses each way,
alternating which goes first. Prints the median compress seconds over the bare prefill (the
best of two), the probes each fit counted, and the stored bytes.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ttft import corpus_text  # noqa: E402

from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.compress.key_basis import key_basis_scope  # noqa: E402
from kdnctl.compress.layer_profile import profile_scope, wants_profile  # noqa: E402
from kdnctl.compress.stages import payload_size as ps  # noqa: E402
from kdnctl.engine.prefill import bare_prefill_seconds  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def main() -> None:
    torch.set_num_threads(2)
    lm = load_model(dtype="float32")
    probes = [0]
    counted = ps.PayloadSize.blob_sizes

    def blob_sizes(self, alpha):
        if alpha not in self._seen:
            probes[0] += 1
        return counted(self, alpha)

    ps.PayloadSize.blob_sizes = blob_sizes
    sizes = sys.argv[1] if len(sys.argv) > 1 else "1024,2048,4096"
    print("| tokens | fit | compress / bare prefill | probes | stored bytes |")
    print("|---:|---|---:|---|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in sizes.split(",")):
            text = corpus_text(lm.tokenizer, n)
            doc = Document("d", text, "probe", hashlib.sha256(text.encode()).hexdigest())
            ids = PromptFormat.for_tokenizer(lm.tokenizer).document_ids(lm.tokenizer, text)[0]
            store = Store(Path(tmp) / f"s{n}")
            ingest_documents(store, lm, [doc], IngestOptions())
            bare = min(bare_prefill_seconds(lm.model, ids) for _ in range(2))
            with store.writer(), key_basis_scope(store, lm, CompressRecipe().uses_key_basis), \
                    profile_scope(store, lm, wants_profile(CompressRecipe())):
                pass
            runs: dict[str, list] = {}
            for rep in range(3):
                for fit in (("search", "secant") if rep % 2 == 0 else ("secant", "search")):
                    recipe = CompressRecipe(budget=0.25, options={"fit": fit}) if fit == "secant" else CompressRecipe(budget=0.25)
                    probes[0] = 0
                    with store.writer():
                        t = time.perf_counter()
                        res = compress_document(store, "d", recipe, lm=lm, label=f"{fit}{rep}")
                        took = time.perf_counter() - t
                    runs.setdefault(fit, []).append((took, probes[0], res.bytes))
            for fit, xs in runs.items():
                print(f"| {len(ids)} | {fit} | {statistics.median(x[0] for x in xs) / bare:.2f} | "
                      f"{[x[1] for x in xs]} | {xs[0][2]} |", flush=True)
            store.close()


if __name__ == "__main__":
    main()
