"""Time to first token from stored KV against its floor and against what a user would do instead.

    python bench/ttft.py [--sizes 1024,2048,4096,8000] [--repeats 3] [--profile] [--model PATH]

One run, same machine, same tokens, every timing a median over --repeats, the repetitions
interleaved (each runs every path once; one repetition for full prefills of 8k tokens and more:
they take tens of seconds on a 2-core machine). Objects
come from the page cache (the store was just written); cold reads are not measured because
dropping the page cache would disturb the other jobs on a shared machine.

Columns (time to first token, seconds):

* oracle: the question run over a cache already in memory (zero load cost): the floor. Shown
  twice: ``oracle`` as kdnctl runs the question now (cache with spare room, kdnctl's attention
  function with its boolean causal mask, logits for the last token only) and ``oracle (old)`` as
  before (``DynamicCache``, whose forward concatenates the whole cache, the model's default
  attention with transformers' masks, and logits for every question token).
* kdnctl full / b1-int8 / default: ``load_document`` (read, check every byte, decode, dequantize,
  place into the cache) + the question + the first token, as ``kdnctl ask`` runs them: an ec
  version's decode runs behind the question's forward, layer group by layer group
  (``overlap=True``; the per-step profile below decodes first, so its steps add up). A small
  table beside it times the default decoded first too, in the same repetitions. ``default`` is what ``kdnctl compress``
  with no options stores (``--budget 0.25``: ``ec``, entropy-coded codes decoded on the host).
* torch.load / safetensors: what a user would do without kdnctl: ``torch.load`` of the raw
  per-layer K/V (``weights_only``) or safetensors ``load_file`` (no integrity check either),
  then ``DynamicCache`` and the question with last-token logits.
* full prefill: document + question from scratch.

A second table compares load alone (no question): kdnctl's load of the ``full`` version against
``torch.load`` / ``load_file`` of the same tensors, in wall time and in the process's CPU time
(both loads run on one thread: on a machine shared with other jobs, CPU time is what the load
itself costs, wall time adds however long it waited for a core). The third: ingest tokens/s against a bare
forward pass over the same tokens (``bare_prefill_seconds``; both the best of the same number of
interleaved runs), with the statistics' cost, and
the seconds per 1,000 tokens of ingest and of compressing with the default (``--budget 0.25``;
what a model's first compress in a store measures once, its key basis and Fisher profile, is
timed apart, before it).
The load table gives the default's whole load in GB/s of the fp32 cache it fills; ``--profile``
also its decode step alone (inflate, unpack, dequantize, key basis, RoPE). ``--profile`` adds the per-step breakdown of the stored path (one reader, so steps add up; the ec
decode itself runs on every core, up to 16: ``kdnctl.quant.ec_batch.default_workers``).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kdnctl.compress.document import CompressRecipe, compress_document  # noqa: E402
from kdnctl.compress.key_basis import key_basis_scope  # noqa: E402
from kdnctl.compress.layer_profile import profile_scope, wants_profile  # noqa: E402
from kdnctl.ingest.corpus import Document  # noqa: E402
from kdnctl.engine.attention import AttentionState, kdn_attention  # noqa: E402
from kdnctl.engine.hf import LoadProfile, forward_suffix, full_prefill_generate, generate, load_document  # noqa: E402
from kdnctl.ingest import IngestOptions, ingest_documents  # noqa: E402
from kdnctl.models.load import load_model  # noqa: E402
from kdnctl.engine.prefill import bare_prefill_seconds  # noqa: E402
from kdnctl.ingest.prompting import PromptFormat  # noqa: E402
from kdnctl.store import Store  # noqa: E402
from kdnctl.models.cache_args import cache_arg  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "corpus"
QUESTION = "How long does it take to charge the battery to 80 %?"


def corpus_text(tokenizer, n_tokens: int) -> str:
    text = "\n\n".join(p.read_text() for p in sorted(EXAMPLES.iterdir()))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < n_tokens:
        ids = ids + ids
    return tokenizer.decode(ids[: n_tokens - 30])


def _timed_cpu(fn, lm) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process): on a machine shared with other jobs the wall
    time of a memory-bound load swings with whatever else runs; its CPU time much less."""
    c, t = time.process_time(), time.perf_counter()
    fn()
    sync(lm)
    return time.perf_counter() - t, time.process_time() - c


def med(fn, n: int) -> float:
    return statistics.median(fn() for _ in range(n))


@torch.inference_mode()
def oracle_seconds(lm, ctx, question, *, old: bool) -> float:
    """The question over a cache already in memory; the cache is built outside the clock."""
    from transformers import DynamicCache

    model = lm.model
    if old:
        cache = DynamicCache(ddp_cache_data=list(zip(ctx.keys, ctx.values)), config=model.config)
    else:
        from kdnctl.engine.kvcache import cache_over, prealloc_buffers

        cache = cache_over(model.config, [(*prealloc_buffers(k, v, 256), k.shape[2]) for k, v in zip(ctx.keys, ctx.values)])
    ids = torch.tensor([question], device=lm.device)
    pos = torch.arange(ctx.next_position, ctx.next_position + len(question), device=lm.device)[None]
    # the new forward runs under kdnctl's attention function, as the stored path does
    # (forward_suffix); the old one under the model's default (sdpa and transformers' masks)
    attn = contextlib.nullcontext() if old else kdn_attention(model, AttentionState())
    sync(lm)
    t = time.perf_counter()
    with attn:
        out = model(input_ids=ids, **cache_arg(model, cache), position_ids=pos, use_cache=True,
                    logits_to_keep=0 if old else 1)
    int(out.logits[0, -1].argmax())
    return time.perf_counter() - t


@torch.inference_mode()
def user_ttft(lm, load, question, start: int) -> tuple[float, float]:
    """(load seconds, time to first token) of a user's own load + DynamicCache + question."""
    from transformers import DynamicCache

    t = time.perf_counter()
    kv = load()
    sync(lm)
    t_load = time.perf_counter() - t
    cache = DynamicCache(ddp_cache_data=kv, config=lm.model.config)
    out = lm.model(input_ids=torch.tensor([question], device=lm.device), **cache_arg(lm.model, cache),
                   position_ids=torch.arange(start, start + len(question), device=lm.device)[None],
                   use_cache=True, logits_to_keep=1)
    int(out.logits[0, -1].argmax())
    return t_load, time.perf_counter() - t


def save_user_files(tmp: Path, ctx) -> tuple[Path, Path]:
    from safetensors.torch import save_file

    pt, st = tmp / "kv.pt", tmp / "kv.safetensors"
    torch.save([(k.contiguous(), v.contiguous()) for k, v in zip(ctx.keys, ctx.values)], pt)
    tensors = {}
    for i, (k, v) in enumerate(zip(ctx.keys, ctx.values)):
        tensors[f"{i}.k"], tensors[f"{i}.v"] = k.contiguous(), v.contiguous()
    save_file(tensors, st)
    return pt, st


def sync(lm) -> None:
    """Wait for queued GPU work so a clock read after it measures it (a no-op on CPU)."""
    if lm.device.type == "cuda":
        torch.cuda.synchronize(lm.device)


def torch_loader(path: Path, device):
    # What a user would write: straight onto the model's device.
    return lambda: torch.load(path, weights_only=True, map_location=device)


def st_loader(path: Path, n_layers: int, device):
    from safetensors.torch import load_file

    def load():
        t = load_file(path, device=str(device))
        return [(t[f"{i}.k"], t[f"{i}.v"]) for i in range(n_layers)]

    return load


def stored_ttft(lm, store, doc_id, label, question, profile=None, workers=None, overlap: bool = True) -> float:
    """What ``kdnctl ask`` does: load (an ec decode behind the question's forward, layer group by
    layer group; ``overlap`` False: decoded first) and answer."""
    t0 = time.perf_counter()
    ctx = load_document(lm, store, doc_id, label, workers=workers, profile=profile, overlap=overlap)
    return generate(lm, ctx, question, max_new_tokens=1, t0=t0).ttft_s


@torch.inference_mode()
def profile_row(lm, store, doc_id, label, question, repeats: int) -> dict:
    """Per-step seconds of the stored path, one worker so the steps add up (medians)."""
    runs = []
    for _ in range(repeats):
        prof = LoadProfile()
        ctx = load_document(lm, store, doc_id, label, workers=1, profile=prof)
        t = time.perf_counter()
        cache = ctx.make_cache(lm.model.config)
        sync(lm)
        build = time.perf_counter() - t
        ids = torch.tensor([question], device=lm.device)
        pos = torch.arange(ctx.next_position, ctx.next_position + len(question), device=lm.device)[None]
        sync(lm)
        t = time.perf_counter()
        with kdn_attention(lm.model, AttentionState(bias=dict(ctx.bias))):  # as forward_suffix runs it
            out = lm.model(input_ids=ids, **cache_arg(lm.model, cache), position_ids=pos, use_cache=True, logits_to_keep=1)
        sync(lm)
        suffix = time.perf_counter() - t
        t = time.perf_counter()
        int(out.logits[0, -1].argmax())
        first = time.perf_counter() - t
        runs.append({"read": prof.read, "hash": prof.hash, "decode": prof.decode, "dequantize": prof.dequantize,
                     "place": prof.place, "cache build": build, "suffix prefill": suffix, "first token": first,
                     "MB": prof.nbytes / 1e6})
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1024,2048,4096,8000")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="per-step breakdown of the stored path")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the CPU table is the README's first)")
    ap.add_argument("--dtype", default="float32", help="model dtype (float32 keeps the identity tests' dtype)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default); 1 keeps "
                    "timings sane on a machine shared by many jobs (no OpenMP oversubscription)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lm = load_model(args.model, device=args.device, dtype=args.dtype)
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    question = fmt.question_ids(lm.tokenizer, QUESTION)
    rows, loads, ingests, profiles, overlaps = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        store = Store(tmp / "store")
        # One-time costs (CUDA context, cuBLAS, Triton compiles, the scorer's lazily cast head,
        # numba's kernels) are paid once per process, not per document: pay them off the clock,
        # on every path.
        warm = corpus_text(lm.tokenizer, 300)
        bare_prefill_seconds(lm.model, fmt.document_ids(lm.tokenizer, warm)[0])
        warm_store = Store(tmp / "warm")
        ingest_documents(warm_store, lm, [Document("warm.txt", warm, "bench", hashlib.sha256(warm.encode()).hexdigest())],
                         IngestOptions())
        load_document(lm, warm_store, "warm.txt")
        # the compress path too (numba loads its kernels from its disk cache at their first call,
        # once per process), so that the first size's compress does not pay for it
        with warm_store.writer():
            compress_document(warm_store, "warm.txt", CompressRecipe(), lm=lm, label="default")
        load_document(lm, warm_store, "warm.txt", "default")
        warm_store.close()
        for size in [int(s) for s in args.sizes.split(",")]:
            reps = args.repeats
            slow_reps = 1 if size >= 8000 else min(reps, 2)
            text = corpus_text(lm.tokenizer, size)
            doc = Document(f"bench-{size}.txt", text, "bench", hashlib.sha256(text.encode()).hexdigest())
            ids, _ = fmt.document_ids(lm.tokenizer, text)
            # bare prefill and ingest alike: the best of the same number of runs, interleaved (the
            # runs after the first ingest into a store of their own, then dropped)
            bare, ingest_s, report = float("inf"), float("inf"), None
            for r in range(slow_reps):
                bare = min(bare, bare_prefill_seconds(lm.model, ids))
                into = store if r == 0 else Store(tmp / f"ingest-{size}-{r}")
                t = time.perf_counter()
                rep = ingest_documents(into, lm, [doc], IngestOptions())
                took = time.perf_counter() - t
                if took < ingest_s:
                    ingest_s, report = took, rep
                if into is not store:
                    into.close()
                    shutil.rmtree(tmp / f"ingest-{size}-{r}")
            with store.writer():
                compress_document(store, doc.doc_id, CompressRecipe(budget=None, keep=1.0, quant="int8"), label="b1-int8")
                # what a model's first compress in a store measures once (its key basis and Fisher
                # profile), timed apart from the compress that then reads them
                t = time.perf_counter()
                with key_basis_scope(store, lm, CompressRecipe().uses_key_basis), \
                        profile_scope(store, lm, wants_profile(CompressRecipe())):
                    pass
                once_s = time.perf_counter() - t
                t = time.perf_counter()
                compress_document(store, doc.doc_id, CompressRecipe(), lm=lm, label="default")
                compress_s = time.perf_counter() - t
            ctx = load_document(lm, store, doc.doc_id)
            pt, st = save_user_files(tmp, ctx)
            n_layers = len(ctx.keys)
            # interleaved: every repetition runs each path once, so load from other jobs on a
            # shared machine falls on all of them alike (medians over repetitions)
            runs: dict[str, list] = {}
            for _ in range(reps):
                for name, fn in (
                    ("oracle", lambda: oracle_seconds(lm, ctx, question, old=False)),
                    ("oracle_old", lambda: oracle_seconds(lm, ctx, question, old=True)),
                    ("full_kv", lambda: stored_ttft(lm, store, doc.doc_id, "full", question)),
                    ("int8_kv", lambda: stored_ttft(lm, store, doc.doc_id, "b1-int8", question)),
                    ("ec_kv", lambda: stored_ttft(lm, store, doc.doc_id, "default", question)),
                    ("ec_first", lambda: stored_ttft(lm, store, doc.doc_id, "default", question, overlap=False)),
                    ("tl", lambda: user_ttft(lm, torch_loader(pt, lm.device), question, ctx.next_position)),
                    ("sl", lambda: user_ttft(lm, st_loader(st, n_layers, lm.device), question, ctx.next_position)),
                ):
                    runs.setdefault(name, []).append(fn())
            med_of = {k: statistics.median(v) for k, v in runs.items() if k not in ("tl", "sl")}
            oracle, oracle_old, full_kv, int8_kv, ec_kv = (med_of[k] for k in ("oracle", "oracle_old", "full_kv", "int8_kv",
                                                                                "ec_kv"))
            tl, sl = runs["tl"], runs["sl"]
            # load alone: each loader's repetitions back to back after one untimed warm-up, so each
            # reuses the memory its previous call freed (glibc for torch.load / load_file, the
            # buffer pool for kdnctl): every loader in its own steady state
            load_alone, load_cpu = {}, {}
            for name, fn in (("tl", torch_loader(pt, lm.device)), ("sl", st_loader(st, n_layers, lm.device)),
                             ("kd", lambda: load_document(lm, store, doc.doc_id)),
                             ("i8", lambda: load_document(lm, store, doc.doc_id, "b1-int8")),
                             ("ec", lambda: load_document(lm, store, doc.doc_id, "default"))):
                fn()
                both = [_timed_cpu(fn, lm) for _ in range(reps)]
                load_alone[name] = statistics.median(w for w, _ in both)
                load_cpu[name] = statistics.median(c for _, c in both)
            kd_load, i8_load = load_alone["kd"], load_alone["i8"]
            full = med(lambda: full_prefill_generate(lm, ctx.token_ids, question, max_new_tokens=1).ttft_s, slow_reps)
            m = statistics.median
            rows.append((len(ids), oracle, oracle_old, full_kv, int8_kv, ec_kv, m(x[1] for x in tl), m(x[1] for x in sl),
                         full))
            overlaps.append((len(ids), ec_kv, med_of["ec_first"], full_kv))
            loads.append((len(ids), ctx.nbytes / 1e6, kd_load, i8_load, load_alone["ec"], load_alone["tl"],
                          load_alone["sl"], load_cpu["kd"], load_cpu["tl"]))
            fp32_mb = sum(k.numel() + v.numel() for k, v in zip(ctx.keys, ctx.values)) * 4 / 1e6
            ingests.append((len(ids), len(ids) / ingest_s, len(ids) / bare, report, compress_s, once_s))
            if args.profile:
                for label in ("full", "b1-int8", "default"):
                    profiles.append((len(ids), label, {**profile_row(lm, store, doc.doc_id, label, question, reps),
                                                       "fp32 MB": fp32_mb}))
            print(f"# done {size}: ttft {rows[-1]} load {loads[-1]} ingest {ingests[-1][:3]} "
                  f"prefill+stats {report.prefill_seconds:.3f} write {report.write_seconds:.3f} "
                  f"profile {profiles[-3:] if args.profile else ''}", file=sys.stderr, flush=True)
            del ctx
            pt.unlink()
            st.unlink()
    where = torch.cuda.get_device_name(lm.device) if lm.device.type == "cuda" else "CPU"
    print(f"device: {where}, model dtype {args.dtype}; question: {len(question)} tokens; medians of {args.repeats} "
          f"(full prefill: fewer at 8k); torch threads: {torch.get_num_threads()}\n")
    print("| context tokens | oracle (in-memory) | oracle (old forward) | kdnctl full | kdnctl b1-int8 | kdnctl default "
          "(0.25) | torch.load | safetensors (no check) | full prefill | kdnctl speedup vs prefill (full, default) | "
          "kdnctl / oracle (full, b1-int8, default) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, o, oo, f, i8, ec, tl, sl, pf in rows:
        print(f"| {n} | {o:.3f} | {oo:.3f} | {f:.3f} | {i8:.3f} | {ec:.3f} | {tl:.3f} | {sl:.3f} | {pf:.3f} | "
              f"{pf / f:.1f}x, {pf / ec:.1f}x | {f / o:.2f}, {i8 / o:.2f}, {ec / o:.2f} |")
    print("\nThe default's time to first token with its decode behind the question's forward (what `kdnctl ask` "
          "does, the column above) and decoded first, same repetitions, seconds:\n")
    print("| context tokens | behind the forward | decoded first | behind / first | behind / full | first / full |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, behind, first, full_kv in overlaps:
        print(f"| {n} | {behind:.3f} | {first:.3f} | {behind / first:.2f} | {behind / full_kv:.2f} | {first / full_kv:.2f} |")
    print("\nLoad alone (no question), seconds:\n")
    print("| context tokens | MB (full) | kdnctl load full | kdnctl load b1-int8 | kdnctl load default | torch.load | "
          "safetensors load_file | kdnctl full / torch.load | CPU s: kdnctl full, torch.load | kdnctl full / torch.load (CPU) | "
          "default: GB/s of fp32 cache (whole load) | default load / full load |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, mb, kd, i8, ec, tl, sl, kd_cpu, tl_cpu in loads:
        print(f"| {n} | {mb:.0f} | {kd:.3f} | {i8:.3f} | {ec:.3f} | {tl:.3f} | {sl:.3f} | {kd / tl:.2f} | "
              f"{kd_cpu:.3f}, {tl_cpu:.3f} | {kd_cpu / max(tl_cpu, 1e-9):.2f} | {mb / 1e3 / ec:.2f} | {ec / kd:.2f}x |")
    print("\nIngest vs bare prefill:\n")
    print("| context tokens | ingest tok/s | bare prefill tok/s | ingest/bare | prefill + statistics s | "
          "statistics s (vs bare) | write s | ingest s per 1k tokens | compress default (0.25) s per 1k tokens | "
          "compress / bare prefill | model's key basis and Fisher profile s (once per store) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, ing, bare, rep, comp, once in ingests:
        print(f"| {n} | {ing:.0f} | {bare:.0f} | {ing / bare:.2f} | {rep.prefill_seconds:.3f} | "
              f"{rep.prefill_seconds - n / bare:.3f} | {rep.write_seconds:.3f} | {1e3 / ing:.2f} | {1e3 * comp / n:.2f} | "
              f"{comp / (n / bare):.2f}x | {once:.2f} |")
    if profiles:
        steps = list(profiles[0][2])
        print("\nStored path, per step (seconds, one reader, the ec decode on two threads; MB read):\n")
        print("| context tokens | version | " + " | ".join(steps) + " |")
        print("|---:|---|" + "---:|" * len(steps))
        for n, label, p in profiles:
            print(f"| {n} | {label} | " + " | ".join(f"{p[s]:.4f}" if "MB" not in s else f"{p[s]:.0f}" for s in steps) + " |")
        print("\nDecode throughput of the default (its dequantize step: inflate, unpack, dequantize, key basis, RoPE, "
              "written into the cache; two threads), GB/s of fp32 output:\n")
        print("| context tokens | fp32 MB | dequantize s | GB/s |\n|---:|---:|---:|---:|")
        for n, label, p in profiles:
            if label == "default":
                print(f"| {n} | {p['fp32 MB']:.0f} | {p['dequantize']:.4f} | {p['fp32 MB'] / 1e3 / max(p['dequantize'], 1e-9):.2f} |")


if __name__ == "__main__":
    main()
