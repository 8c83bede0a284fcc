"""The scale fit's counting kernels (``kdnctl/kernels/ec/deflate_size.py``) as they are against an
earlier revision's, in one process: compress seconds of the 0.25 default against a bare prefill.

    python research/probes/count_kernels_ab.py [--rev 0eb1da7] [--sizes 1024,2048] [--repeats 5]

For each size, one document of the example corpus (as ``bench/ttft.py`` builds it) is ingested;
then the default compress (``CompressRecipe()``, the key basis and Fisher profile already in the
store) runs with this checkout's counting kernels and with those of ``--rev`` (read from git,
compiled beside them, swapped into the module the compress calls), taking turns, each into a
label of its own; a bare prefill of the same tokens runs between them. Prints medians of
``--repeats`` and whether the two sides stored the same tensors (they must: the kernels count
the same bytes, so the fit lands on the same scale; the objects differ only by their labels).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from ttft import corpus_text  # noqa: E402

from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.engine.prefill import bare_prefill_seconds  # noqa: E402
from kdnctl.format.bundle import decode_bundle  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.kernels.ec import deflate_size  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.store import Store  # noqa: E402

SWAPPED = ("codes_blob_bytes", "spread_bins_exact")


def kernels_at(rev: str, into: Path) -> dict:
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kdnctl/kernels/ec/deflate_size.py"], check=True,
                         capture_output=True, text=True).stdout
    src = src.replace("from . import digits", "from kdnctl.kernels.ec import digits")
    src = src.replace("from .zlib_blocks import", "from kdnctl.kernels.ec.zlib_blocks import")
    src = src.replace("cache=True", "cache=False")  # (a second copy must not share this one's disk cache)
    path = into / f"deflate_size_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"deflate_size_{rev}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return {name: getattr(mod, name) for name in SWAPPED}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="0eb1da7")
    ap.add_argument("--sizes", default="1024,2048")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    lm = load_model(dtype="float32")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {args.rev: kernels_at(args.rev, Path(tmp)), "now": {n: getattr(deflate_size, n) for n in SWAPPED}}
        store = Store(Path(tmp) / "store")
        print(f"medians of {args.repeats}, the sides taking turns\n")
        print("| tokens | bare prefill s | compress s, " + args.rev + " | compress s, now | now / " + args.rev +
              " | compress / bare, " + args.rev + " | compress / bare, now | same tensors |")
        print("|---:|---:|---:|---:|---:|---:|---:|---|")
        try:
            for size in (int(x) for x in args.sizes.split(",")):
                text = corpus_text(lm.tokenizer, size)
                doc = Document(f"d{size}.txt", text, "bench", hashlib.sha256(text.encode()).hexdigest())
                ingest_documents(store, lm, [doc], IngestOptions())
                ids = fmt.document_ids(lm.tokenizer, text)[0]
                times, bare, objects = {k: [] for k in sides}, [], {}
                for rep in range(args.repeats + 1):
                    for name in (list(sides) if rep % 2 else list(reversed(sides))):
                        for k, fn in sides[name].items():
                            setattr(deflate_size, k, fn)
                        label = f"{name}-{rep}"
                        t = time.perf_counter()
                        with store.writer():
                            compress_document(store, doc.doc_id, CompressRecipe(), lm=lm, label=label)
                        if rep:  # (the first round compiles, and measures the store's key basis and profile)
                            times[name].append(time.perf_counter() - t)
                        objects[name] = [{k: v.numpy().tobytes() for k, v in decode_bundle(store.read_object(c.object)).tensors.items()}
                                         for c in store.get_version(doc.doc_id, label).chunks]
                    bare.append(bare_prefill_seconds(lm.model, ids))
                b = statistics.median(bare[1:])
                old, now = statistics.median(times[args.rev]), statistics.median(times["now"])
                print(f"| {len(ids)} | {b:.3f} | {old:.3f} | {now:.3f} | {now / old:.2f} | {old / b:.2f} | {now / b:.2f} | "
                      f"{objects[args.rev] == objects['now']} |", flush=True)
        finally:
            for k, fn in sides["now"].items():
                setattr(deflate_size, k, fn)
            store.close()


if __name__ == "__main__":
    main()
