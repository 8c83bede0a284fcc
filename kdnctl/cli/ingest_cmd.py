"""`kdnctl ingest`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

from pathlib import Path
from typing import List, Optional

import typer

from .common import (JsonOpt, ModelOpt, BatchOpt, RayOpt, StoreOpt, WorkersOpt, emit_json, load_lm, message, open_store,
                     doc_done, progress_bar)


def ingest(
    paths: List[Path] = typer.Argument(..., help="Files or directories (.txt .md .rst .html .jsonl)."),
    store: Optional[Path] = StoreOpt,
    model: Optional[str] = ModelOpt,
    chunk_tokens: int = typer.Option(256, "--chunk-tokens", help="Tokens per stored chunk."),
    mode: str = typer.Option("prefix", "--mode", help="prefix: chunks reusable behind the same prefix (label full); "
                             "independent: each chunk prefilled on its own after the prompt header, composable "
                             "in any order (label independent, see docs/compose.md)."),
    window: int = typer.Option(32, "--window", help="Observation window (last W queries) for statistics."),
    no_stats: bool = typer.Option(False, "--no-stats", help="Skip attention statistics (faster, no scoring later)."),
    stats: str = typer.Option("default", "--stats", help="default (surprisal + last-window attention: what the default "
                              "recipe and snapkv need) | all (adds accumulated attention for h2o/adaptive; compress "
                              "can also compute it later) | comma list of window,accum,surprisal."),
    kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="Stored K/V dtype: float32 | float16 | bfloat16 "
                                           "(default: the model's dtype; fp16/bf16 halve an fp32 store)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="float32 (CPU default), float16, bfloat16."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    ray: Optional[str] = RayOpt,
    workers: Optional[int] = WorkersOpt,
    batch: int = BatchOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Prefill documents and store their KV per chunk."""
    from ..ingest.corpus import read_corpus
    from ..errors import UsageError
    from ..ingest import IngestOptions

    from ..ingest.prefix import DEFAULT_STATS
    from ..engine.prefill import ALL_STATS

    names = DEFAULT_STATS if stats == "default" else ALL_STATS if stats == "all" else tuple(
        n.strip() for n in stats.split(",") if n.strip())
    opts = IngestOptions(chunk_tokens=chunk_tokens, window=window, stats=not no_stats, stat_names=names,
                         kv_dtype=kv_dtype)  # checks the values
    if mode not in ("prefix", "independent"):
        raise UsageError(f"--mode must be prefix or independent, got {mode!r}")
    docs, skipped = read_corpus(paths)
    for s in skipped:
        message(f"warning: skipped {s.path}: {s.reason}")
    if not docs:
        raise UsageError("no readable documents in the given paths", hint="supported: .txt .md .rst .html .jsonl")
    from ..store.records import id_problem

    bad = [(d.source, id_problem("doc_id", d.doc_id)) for d in docs if id_problem("doc_id", d.doc_id)]
    if bad:  # before the model loads and before any prefill
        raise UsageError(f"{len(bad)} document id(s) cannot be stored, e.g. {bad[0][0]}: {bad[0][1]}",
                         hint="document ids must be non-empty, without NUL, at most 200 bytes")
    if ray is not None and (mode != "prefix" or device is not None):
        raise UsageError("--ray runs --mode prefix, on the GPUs Ray gives each worker (no --device)")
    if ray is None and workers is not None:
        raise UsageError("--workers needs --ray ADDRESS|local")
    st = open_store(store, create=True)  # a damaged or wrong --store fails before the model loads
    if ray is not None:
        from ..distributed.ingest import ingest_on_ray

        with progress_bar(len(docs), "ingest", unit="doc") as bar:
            report = ingest_on_ray(st, docs, opts, address=ray, workers=workers, model=model, dtype=dtype,
                                   batch_size=batch,
                                   on_progress=lambda n, tps: (bar.update(n), bar.set_postfix_str(f"{tps:.0f} tok/s")))
    else:
        report = _ingest_here(st, load_lm(model, dtype, device), docs, opts, mode)
    report.skipped = skipped
    _print_report(report, skipped, mode, as_json)


def _ingest_here(st, lm: LoadedModel, docs, opts, mode):
    from ..ingest import ingest_documents

    total = sum(len(lm.tokenizer(d.text, add_special_tokens=False).input_ids) for d in docs)
    with progress_bar(total, "ingest") as bar:
        if mode == "independent":
            from ..ingest.independent import ingest_independent

            report = ingest_independent(st, lm, docs, opts, on_progress=bar.update)
        else:
            report = ingest_documents(st, lm, docs, opts, on_progress=bar.update, on_doc=doc_done("ingest"))
    return report


def _print_report(report, skipped, mode, as_json) -> None:
    data = report.as_dict()
    if as_json:
        emit_json(data)
    elif mode == "independent":
        message(
            f"ingested {len(report.ingested)} document(s) as independent chunks, {len(report.unchanged)} unchanged, "
            f"{len(skipped)} skipped; {report.chunks_stored} chunk(s) stored, {report.chunks_reused} reused; "
            f"{report.tokens} tokens prefilled in {report.seconds:.1f}s"
        )
    else:
        message(
            f"ingested {len(report.ingested)} document(s), {len(report.unchanged)} unchanged, "
            f"{len(skipped)} skipped; {report.tokens} tokens in {report.seconds:.1f}s "
            f"({report.tokens_per_s:.0f} tok/s); statistics = {100 * data['stats_fraction']:.2f}% of KV bytes"
        )


def register(app: typer.Typer) -> None:
    app.command("ingest")(ingest)
