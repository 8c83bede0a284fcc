"""`kdnctl eval-compose`: naive concatenation vs selective recompute vs full prefill on
multi-chunk questions (see kdnctl/evaluation/multichunk.py and docs/compose.md)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import JsonOpt, ModelOpt, StoreOpt, emit_json, load_lm, message, open_store, progress_bar

DEFAULT_QA = Path("examples/multichunk_qa.jsonl")


def eval_compose(
    qa: Path = typer.Option(DEFAULT_QA, "--qa", help="Multi-chunk QA jsonl: {question, answer, aliases?, docs, evidence}."),
    corpus: Optional[List[Path]] = typer.Option(None, "--corpus", help="Ingest these paths as independent chunks first (skips unchanged)."),
    chunk_tokens: int = typer.Option(512, "--chunk-tokens", help="Chunk budget for --corpus ingest."),
    n_chunks: int = typer.Option(4, "--n-chunks", help="Chunks per question (evidence + distractors)."),
    min_chunk_tokens: int = typer.Option(256, "--min-chunk-tokens", help="Smallest distractor chunk."),
    recompute: str = typer.Option("0,0.15,0.3", "--recompute", help="Comma-separated recompute ratios (0 = naive)."),
    seed: int = typer.Option(0, "--seed", help="Seed for distractor choice and chunk order."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N questions."),
    max_new_tokens: int = typer.Option(24, "--max-new-tokens"),
    store: Optional[Path] = StoreOpt,
    model: Optional[str] = ModelOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Accuracy and time to first token of composed chunks vs a full prefill."""
    from ..errors import UsageError
    from ..evaluation.multichunk import build_cases, evaluate_compose, load_multichunk_qa

    try:
        levels = [float(x) for x in recompute.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--recompute must be comma-separated numbers, got {recompute!r}") from None
    if not levels or any(not 0 <= r <= 1 for r in levels):
        raise UsageError(f"--recompute ratios must be in [0, 1], got {recompute!r}")
    if n_chunks < 1:
        raise UsageError(f"--n-chunks must be >= 1, got {n_chunks}")
    items = load_multichunk_qa(qa)
    if limit is not None:
        items = items[: max(limit, 0)]
    st = open_store(store, create=bool(corpus))
    lm = load_lm(model)
    if corpus:
        from ..ingest.corpus import read_corpus
        from ..ingest import IngestOptions
        from ..ingest.independent import ingest_independent

        docs, skipped = read_corpus(corpus)
        for s in skipped:
            message(f"warning: skipped {s.path}: {s.reason}")
        rep = ingest_independent(st, lm, docs, IngestOptions(chunk_tokens=chunk_tokens))
        message(f"independent ingest: {len(rep.ingested)} ingested, {len(rep.unchanged)} unchanged, "
                f"{rep.chunks_stored} chunk(s) stored in {rep.seconds:.1f}s")
    cases = build_cases(st, items, n_chunks=n_chunks, min_tokens=min_chunk_tokens, seed=seed, fingerprint=lm.fingerprint)
    with progress_bar(len(cases) * (len(levels) + 1), "eval-compose", unit="run") as bar:
        result = evaluate_compose(lm, st, cases, recompute_levels=levels, max_new_tokens=max_new_tokens,
                                  on_step=bar.update)
    if as_json:
        emit_json(result)
        return
    s = result["summary"]
    print(f"{s['questions']} questions, {s['chunks_per_question_mean']} chunks / {s['context_tokens_mean']} tokens "
          f"per context on average; {s['multi_evidence_chunk_questions']} need 2+ evidence chunks")
    print(f"{'method':<16} {'accuracy':>9} {'=full ans':>10} {'=full tok1':>11} {'KL tok1':>8} {'ttft mean':>10} "
          f"{'ttft median':>12} {'load':>7} {'recomputed':>11}")
    for m in result["methods"]:
        print(f"{m['method']:<16} {m['accuracy']:>9.3f} {m['same_answer_as_full']:>10.3f} {m['first_token_same_as_full']:>11.3f} "
              f"{m['first_token_kl_mean']:>8.3f} {m['ttft_mean_s']:>9.3f}s {m['ttft_median_s']:>11.3f}s "
              f"{m['load_mean_s']:>6.3f}s {m['recomputed_tokens_mean']:>11.1f}")


def register(app: typer.Typer) -> None:
    app.command("eval-compose")(eval_compose)
