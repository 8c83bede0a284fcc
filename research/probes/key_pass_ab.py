"""The key basis's last pass as it is (the rotated rows times the steps plus the means, in the
RoPE pass) against a revision's (the basis scaled by the steps per job, the means as the
matmul's bias), in one process: the decode's CPU seconds and the time to first token.

    python research/probes/key_pass_ab.py [--rev d7479cc] [--sizes 4096,8000] [--repeats 9]

``--rev``'s ``ec_batch._decode_chunk_role`` and ``basis_scratch`` (``kdnctl/quant/ec_batch.py``)
and its compiled kernels (``cpu_jit.py``) are read from git and swapped in for its side.
Per size: a whole decode of the default into an fp32 cache on one worker (CPU seconds), each side
in turn, and the time to first token behind the question's forward of ``full``, this checkout and
``--rev`` in rotating order, medians of ``--repeats``; paired medians of now / before.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "research" / "probes")]

import torch  # noqa: E402

import ttft  # noqa: E402
from decode_kernels_ab import kernels_of  # noqa: E402
from default_version import decode_target, default_store, rotating  # noqa: E402
from kdnctl.format.bundle import decode_bundle  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.kernels.ec import cpu  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant import ec_batch  # noqa: E402


def batch_of(rev: str, into: Path):
    """``kdnctl/quant/ec_batch.py`` at ``rev``, as a module of its own."""
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kdnctl/quant/ec_batch.py"],
                         check=True, capture_output=True, text=True).stdout
    src = src.replace("from . import transforms", "from kdnctl.quant import transforms")
    src = src.replace("from .entropy import", "from kdnctl.quant.entropy import")
    src = src.replace("from ..format.key_basis import", "from kdnctl.format.key_basis import")
    path = into / f"ec_batch_{rev}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(f"ec_batch_{rev}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Sides:
    """Swaps ``--rev``'s key pass in (``before``) or leaves this checkout's (``now``)."""

    def __init__(self, rev: str, tmp: Path):
        cpu.kernels()  # (loads ISA-L, which the kernels of ``rev`` bind by name too)
        self.now = (cpu.kernels, ec_batch._decode_chunk_role, ec_batch.basis_scratch)
        old_kernels, old = kernels_of(rev, tmp), batch_of(rev, tmp)
        self.before = (lambda: old_kernels, old._decode_chunk_role, old.basis_scratch)

    def use(self, side: str) -> None:
        kernels, job, scratch = self.before if side == "before" else self.now
        cpu.kernels, ec_batch._decode_chunk_role, ec_batch.basis_scratch = kernels, job, scratch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="d7479cc")
    ap.add_argument("--sizes", default="4096,8000")
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model(dtype="float32")
    q = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, ttft.QUESTION)
    tmp_k = tempfile.TemporaryDirectory()
    sides = Sides(args.rev, Path(tmp_k.name))
    decode_rows, ttft_rows = [], []
    for size in [int(s) for s in args.sizes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            st, doc = default_store(lm, size, Path(tmp))
            bundles = [decode_bundle(st.read_object(c.object)) for c in st.get_version(doc, "default").chunks]
            meta, starts, out = decode_target(bundles)
            # the decode alone, one worker, torch on one thread (as a worker runs it)
            torch.set_num_threads(1)
            cpu_s, caches = {"now": [], "before": []}, {}
            for rep in range(args.repeats + 1):
                for side in (("now", "before") if rep % 2 else ("before", "now")):
                    sides.use(side)
                    c = time.process_time()
                    with torch.inference_mode():
                        ec_batch.decode_into(out, bundles, starts, meta, workers=1)
                    if rep:  # (the first round compiles)
                        cpu_s[side].append(time.process_time() - c)
                    caches[side] = [o.clone() for o in out]
            sides.use("now")
            torch.set_num_threads(2)
            n_tokens = st.get_version(doc, "full").n_tokens
            worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(caches["now"], caches["before"]))
            decode_rows.append((n_tokens, statistics.median(cpu_s["now"]), statistics.median(cpu_s["before"]),
                                statistics.median(a / b for a, b in zip(cpu_s["now"], cpu_s["before"])),
                                torch.equal(caches["now"][1], caches["before"][1]), worst))

            def timed(mode: str) -> float:
                sides.use(mode if mode != "full" else "now")
                try:
                    return ttft.stored_ttft(lm, st, doc, "full" if mode == "full" else "default", q)
                finally:
                    sides.use("now")

            res = rotating(timed, ("full", "now", "before"), args.repeats)
            med = {m: statistics.median(v) for m, v in res.items()}
            ttft_rows.append((n_tokens, med["full"], med["now"], med["before"],
                              statistics.median(a / b for a, b in zip(res["now"], res["before"]))))
            st.close()
    tmp_k.cleanup()
    print(f"medians of {args.repeats}; now: this checkout; before: the key pass of {args.rev}\n")
    print("Decode of the whole version, one worker, CPU seconds:\n")
    print("| tokens | now | before | now / before (paired) | values equal bit for bit | keys: largest difference / largest key |")
    print("|---:|---:|---:|---:|---|---:|")
    for n, a, b, p, eq, worst in decode_rows:
        print(f"| {n} | {a:.4f} | {b:.4f} | {p:.3f} | {eq} | {worst:.1e} |")
    print("\nTime to first token behind the question's forward, seconds:\n")
    print("| tokens | full | now | before | now / full | before / full | now / before (paired) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for n, f, a, b, p in ttft_rows:
        print(f"| {n} | {f:.3f} | {a:.3f} | {b:.3f} | {a / f:.2f} | {b / f:.2f} | {p:.3f} |")


if __name__ == "__main__":
    main()
