"""The model's Fisher profile against each document's own Fisher estimate: how far the layer
multipliers move, and what a `b0.25` compress takes with each, beside a bare prefill.

    python research/probes/fisher_profile.py [--docs examples/corpus] [--repeats 2] [--out DIR] [--time-only]

The documents are ingested once into a temporary store (torch on 2 threads, SmolLM2 fp32).

1. Agreement. Each document's own estimate (seeds 0 and 1, the probe of
   ``kdnctl.allocate.layer_fisher`` over its cache, its own token weights) against the profile
   of the other documents (``kdnctl.allocate.fisher_profile.calibrate``), through the same
   ``layer_multipliers(layer_damage(., steps))`` with the document's own steps: per document,
   the median and extreme factor between the multipliers of seed 0 and the profile, and between
   seeds 0 and 1 (the estimate's own noise).
2. Time. Per document, a first `b0.25` compress with its own estimate and with the store's
   profile, alternating which goes first, key weights forgotten before each, medians of
   ``--repeats``; a bare prefill of the same tokens (one forward, logits of the last token), and
   the profile's one-time measurement on the store.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kdnctl.allocate import fisher_profile as fpro  # noqa: E402
from kdnctl.allocate import layer_fisher as lf  # noqa: E402
from kdnctl.compress import document as cdoc  # noqa: E402
from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.compress.layer_profile import calibration_versions, ensure_profile, samples  # noqa: E402
from kdnctl.compress.stages.quantize import Quantize  # noqa: E402
from kdnctl.engine.prefill import bare_prefill_seconds  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.quant.sensitivity import forget_key_weights  # noqa: E402
from kdnctl.store import Store  # noqa: E402


def factors(a: torch.Tensor, b: torch.Tensor) -> dict:
    r = (a / b).double()
    return {"median": round(float(r.log().abs().median().exp()), 3), "min": round(float(r.min()), 3),
            "max": round(float(r.max()), 3)}


@contextlib.contextmanager
def own_estimates(seen: dict):
    """Compresses in the block use each document's own estimate (no profile) and record its
    seed-0 and seed-1 estimates and steps in ``seen`` by document id."""
    real_scope, real_fisher = cdoc.profile_scope, Quantize.__dict__["layer_fisher"]  # the staticmethod itself

    def fisher(job, head_dim):
        probe = lf.probe_ids(job.lm, job.token_ids, job.header)
        args = (job.lm, job.keys, job.values, probe, int(job.positions.max()) + 1, 0.25 ** job.levels.float())
        est = [lf.channel_fisher(*args, s) for s in (0, 1)]
        seen[job.src.doc_id] = {"est": est, "steps": [tuple(s.clone() for s in b) for b in job.base]}
        return est[0]

    cdoc.profile_scope = lambda *a, **k: contextlib.nullcontext()
    Quantize.layer_fisher = staticmethod(fisher)
    try:
        yield
    finally:
        cdoc.profile_scope, Quantize.layer_fisher = real_scope, real_fisher


@contextlib.contextmanager
def no_profile():
    real = cdoc.profile_scope
    cdoc.profile_scope = lambda *a, **k: contextlib.nullcontext()
    try:
        yield
    finally:
        cdoc.profile_scope = real


def compress_seconds(st, lm, doc_id: str, label: str) -> float:
    forget_key_weights()
    t = time.perf_counter()
    with st.writer():
        compress_document(st, doc_id, CompressRecipe(budget=0.25), lm=lm, label=label)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", default=str(ROOT / "examples" / "corpus"))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="folder for results.json")
    ap.add_argument("--time-only", action="store_true", help="part 2 alone")
    args = ap.parse_args()
    torch.set_num_threads(2)
    lm = load_model(dtype="float32")
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    docs = []
    for p in sorted(Path(args.docs).iterdir()):
        t = p.read_text()
        docs.append(Document(p.name, t, "probe", hashlib.sha256(t.encode()).hexdigest()))
    out: dict = {"agreement": {}, "time": {}}
    with tempfile.TemporaryDirectory() as tmp:
        st = Store(Path(tmp) / "store")
        ingest_documents(st, lm, docs, IngestOptions())
        # 1. agreement
        seen: dict = {}
        with own_estimates(seen):
            for d in ([] if args.time_only else docs):
                compress_seconds(st, lm, d.doc_id, "own")
        versions = calibration_versions(st, lm.fingerprint)
        everything = [] if args.time_only else list(samples(st, [st.get_version(d.doc_id, "full") for d in docs], max_tokens=fpro.CAL_TOKENS))
        for i, d in enumerate([] if args.time_only else docs):
            n = st.get_version(d.doc_id, "full").n_tokens
            rec = seen[d.doc_id]
            others = fpro.calibrate(lm, [s for j, s in enumerate(everything) if j != i])[0]
            own = [lf.layer_multipliers(lf.layer_damage(e, rec["steps"])) for e in rec["est"]]
            prof = lf.layer_multipliers(lf.layer_damage(fpro.as_layers(others), rec["steps"]))
            out["agreement"][d.doc_id] = {"tokens": n, "profile_vs_own": factors(prof, own[0]),
                                          "seed1_vs_seed0": factors(own[1], own[0])}
            print(d.doc_id, json.dumps(out["agreement"][d.doc_id]), flush=True)
        # 2. time
        t = time.perf_counter()
        ensure_profile(st, lm, True)
        out["profile_seconds"] = time.perf_counter() - t
        out["profile_documents"] = [v.doc_id for v in versions]
        for d in docs:
            ids = fmt.document_ids(lm.tokenizer, d.text)[0]
            bare_prefill_seconds(lm.model, ids)
            got: dict = {"own": [], "profile": [], "bare": []}
            for r in range(args.repeats):
                order = ("own", "profile") if r % 2 == 0 else ("profile", "own")
                for how in order:
                    with (no_profile() if how == "own" else contextlib.nullcontext()):
                        got[how].append(compress_seconds(st, lm, d.doc_id, f"t-{how}-{r}"))
                got["bare"].append(bare_prefill_seconds(lm.model, ids))
            row = {k: statistics.median(v) for k, v in got.items()}
            row["tokens"] = len(ids)
            out["time"][d.doc_id] = row
            print(d.doc_id, json.dumps(row), flush=True)
        st.close()
    tok = sum(r["tokens"] for r in out["time"].values()) / 1000
    tot = {k: sum(r[k] for r in out["time"].values()) for k in ("own", "profile", "bare")}
    print(f"\nper 1,000 tokens: own estimate {tot['own'] / tok:.2f} s ({tot['own'] / tot['bare']:.2f}x bare prefill), "
          f"profile {tot['profile'] / tok:.2f} s ({tot['profile'] / tot['bare']:.2f}x), bare prefill "
          f"{tot['bare'] / tok:.2f} s; profile / own {tot['profile'] / tot['own']:.2f}x; measuring the profile once "
          f"{out['profile_seconds']:.1f} s on {len(out['profile_documents'])} documents")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "results.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
