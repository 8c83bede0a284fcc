"""The 0.25 default's compress as it is against the code of 6c09dd2 (the scale fit's probes and
the final encode of ``payload_size.py`` at that revision, read from git, with the frames cut in
numpy and the channel variances by torch), in one process: seconds, and the stored tensors equal.

    python research/probes/compress_ab.py [--sizes 1024,2048,4096] [--repeats 5]

Per size: the example corpus (as ``bench/ttft.py`` builds it) ingested once, its bare prefill
timed (the best of two), then ``kdnctl compress`` with no options (``--budget 0.25``) run
``--repeats`` times per side, alternating which goes first; the model's Fisher profile is
measured before, off the clock. Prints medians, the paired median now / before, each side
against the bare prefill, and whether both sides stored the same tensors.
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
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from ttft import corpus_text  # noqa: E402

from kdnctl.allocate import rate  # noqa: E402
from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.compress.stages import encode  # noqa: E402
from kdnctl.format.bundle import decode_bundle  # noqa: E402
from kdnctl.engine.prefill import bare_prefill_seconds  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.kernels.channel_stats import reference as var_reference  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import entropy, frames  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def numpy_frame_blob(codes, bins, width, compress=None):
    """``frames.frame_blob`` with its frames cut by ``frame_payloads`` (numpy) and deflated by
    zlib one at a time, as before."""
    from kdnctl.quant.coders.deflate import deflate_compress

    compress = compress or deflate_compress
    datas, peaks = frames.frame_payloads(codes, bins, width)
    out = [compress(x) if x else b"" for x in datas]
    return bytes([width, len(out)]) + np.array([len(f) for f in out], "<i4").tobytes() + \
        np.array(peaks, "<i2").tobytes() + b"".join(out)


def tensor_digest(store, doc_id: str, label: str) -> str:
    """sha256 of every tensor of every chunk of a version (names and bytes; not its meta, which
    names the version)."""
    h = hashlib.sha256()
    for c in store.get_version(doc_id, label).chunks:
        b = decode_bundle(store.read_object(c.object))
        for name in sorted(b.tensors):
            h.update(name.encode() + b.tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


REV = "6c09dd2"


def payload_size_of(rev: str):
    """``kdnctl/compress/stages/payload_size.py`` at ``rev``, as a module of its own, its frames
    cut in numpy."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kdnctl/compress/stages/payload_size.py"],
                         check=True, capture_output=True, text=True).stdout
    src = src.replace("from ...", "from kdnctl.").replace("from . import", "from kdnctl.compress.stages import")
    src = src.replace("from .base import", "from kdnctl.compress.stages.base import")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"payload_size_{rev}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(f"payload_size_{rev}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    mod.frame_blob = numpy_frame_blob
    return mod


NOW = (encode.PayloadSize, entropy.frame_blob, rate.channel_var)
BEFORE = (payload_size_of(REV).PayloadSize, numpy_frame_blob, var_reference.channel_var)


def use(side: tuple) -> None:
    encode.PayloadSize, entropy.frame_blob, rate.channel_var = side


def bench_document(lm, size: int, folder: Path):
    """``(store, doc, token ids, bare prefill s)``: ``size`` tokens of the example corpus (as
    ``bench/ttft.py`` builds them) ingested into a store in ``folder``, its bare prefill the best
    of two."""
    text = corpus_text(lm.tokenizer, size)
    doc = Document(f"bench-{size}.txt", text, "bench", hashlib.sha256(text.encode()).hexdigest())
    ids = PromptFormat.for_tokenizer(lm.tokenizer).document_ids(lm.tokenizer, text)[0]
    bare = min(bare_prefill_seconds(lm.model, ids) for _ in range(2))
    store = Store(Path(folder) / f"s{size}")
    ingest_documents(store, lm, [doc], IngestOptions())
    return store, doc, ids, bare


def alternating(store, doc, recipe, lm, sides: dict, repeats: int) -> tuple[dict[str, list[float]], bool]:
    """``(seconds per side, whether every run of every side stored the same tensors)``: one
    compress of ``doc`` with ``recipe`` per side and repetition, the sides' order alternating;
    ``sides``: name -> a function that puts that side's code in place (the first side's is
    left in place). A compress before, off the clock, pays the Fisher profile and the kernels."""
    names = list(sides)
    with store.writer():
        compress_document(store, doc.doc_id, recipe, lm=lm, label=f"warm-{recipe.budget}")
    secs, objects = {k: [] for k in names}, {}
    for rep in range(repeats):
        for name in (names if rep % 2 else names[::-1]):
            sides[name]()
            label = f"{name}-{recipe.budget}-{rep}"
            with store.writer():
                t = time.perf_counter()
                compress_document(store, doc.doc_id, recipe, lm=lm, label=label)
                secs[name].append(time.perf_counter() - t)
            objects.setdefault(name, set()).add(tensor_digest(store, doc.doc_id, label))
    sides[names[0]]()
    digests = set().union(*objects.values())
    return secs, len(digests) == 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model(dtype="float32")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in [int(s) for s in args.sizes.split(",")]:
            store, doc, ids, bare = bench_document(lm, size, Path(tmp))
            secs, same = alternating(store, doc, CompressRecipe(), lm, {"now": lambda: use(NOW), "before": lambda: use(BEFORE)},
                                     args.repeats)
            med = {k: statistics.median(v) for k, v in secs.items()}
            paired = statistics.median(a / b for a, b in zip(secs["now"], secs["before"]))
            rows.append((len(ids), bare, med["now"], med["before"], paired, same))
            store.close()
            print(f"# done {size}", file=sys.stderr, flush=True)
    print(f"medians of {args.repeats}; now: this checkout; before: the compress of {REV}\n")
    print("| tokens | bare prefill s | compress now s | before s | now / before (paired) | now / bare | before / bare | same tensors |")
    print("|---:|---:|---:|---:|---:|---:|---:|---|")
    for n, bare, a, b, p, same in rows:
        print(f"| {n} | {bare:.3f} | {a:.3f} | {b:.3f} | {p:.3f} | {a / bare:.2f} | {b / bare:.2f} | {same} |")


if __name__ == "__main__":
    main()
