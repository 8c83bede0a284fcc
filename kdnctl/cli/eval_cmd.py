"""`kdnctl eval`: compare stored versions of the same documents against the full cache."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import JsonOpt, ModelOpt, StoreOpt, emit_json, load_lm, message, open_store, progress_bar


def eval_versions(
    docs: Optional[List[str]] = typer.Argument(None, help="Document ids (default: those in the QA file, or all)."),
    qa: Optional[Path] = typer.Option(None, "--qa", help="QA jsonl: {doc, question, answer, aliases?}."),
    versions: Optional[str] = typer.Option(None, "--versions", help="Comma-separated labels (default: all)."),
    probes: int = typer.Option(4, "--probes", help="Cloze probes per document (0 = none)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Greedy answer length (default 40; 24 with --tasks)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a quality-vs-budget plot (PNG); with --tasks, quality vs bytes."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Task set: 'realtext' (examples/eval/realtext.jsonl, 130 tasks), 'realtext-multifact' (160 more multi-fact tasks) or a task jsonl; missing contexts are ingested."),
    kinds: Optional[str] = typer.Option(None, "--kinds", help="With --tasks: comma-separated kinds (needle,multifact,continuation)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="With --tasks: the first N tasks of each kind."),
    store: Optional[Path] = StoreOpt,
    model: Optional[str] = ModelOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Accuracy, answer NLL, KL vs full, bytes/token and compression ratio per version."""
    if tasks is not None:
        if qa is not None:
            from ..errors import UsageError

            raise UsageError("--tasks and --qa are separate evaluations", hint="pass one of them")
        _eval_tasks(tasks, kinds, limit, docs, versions, max_new_tokens or 24,
                    plot, store, model, as_json)
        return
    from ..evaluation.qa import evaluate, load_qa

    items = load_qa(qa) if qa else []
    st = open_store(store)
    doc_ids = list(docs) if docs else None
    if doc_ids:
        items = [i for i in items if i.doc in doc_ids]
    if versions:
        labels = [v.strip() for v in versions.split(",") if v.strip()]
    else:
        wanted = set(doc_ids or {i.doc for i in items} or {d.doc_id for d in st.list_documents()})
        labels = sorted({v.label for v in st.list_versions() if v.doc_id in wanted})
    lm = load_lm(model)
    total = len(items) * (len(labels) + 1)
    with progress_bar(total, "eval", unit="q") as bar:
        result = evaluate(lm, st, labels, qa=items, docs=doc_ids, probes_per_doc=probes,
                          max_new_tokens=max_new_tokens or 40, on_step=bar.update)
    if plot:
        from ..evaluation.plot import plot_quality

        plot_quality(result, plot)
        message(f"wrote {plot}")
    if as_json:
        emit_json(result)
        return
    print(f"{'label':<34} {'acc':>6} {'ans_nll':>8} {'kl':>7} {'probe_nll':>9} {'probe_kl':>8} {'B/token':>9} {'ratio':>7}")
    fmt = lambda x, f: ("-" if x is None else format(x, f))  # noqa: E731
    for v in result["versions"]:
        print(f"{v['label']:<34} {fmt(v['accuracy'], '6.3f')} {fmt(v['answer_nll'], '8.3f')} {fmt(v['kl'], '7.3f')} "
              f"{fmt(v['probe_nll'], '9.3f')} {fmt(v['probe_kl'], '8.3f')} {fmt(v['bytes_per_token'], '9.0f')} "
              f"{fmt(v['compression_ratio'], '7.2f')}")


def _eval_tasks(spec, kinds, limit, docs, versions, max_new_tokens, plot, store, model, as_json) -> None:
    from ..evaluation.tasks import default_labels, evaluate_tasks, format_table, ingest_tasks, load_tasks, missing_documents

    items = load_tasks(spec, kinds=[k.strip() for k in kinds.split(",")] if kinds else None, limit=limit)
    if docs:
        items = [t for t in items if t.id in set(docs)]
    st = open_store(store, create=True)
    lm = load_lm(model)
    todo = missing_documents(st, items)
    if todo:
        message(f"ingesting {len(todo)} task contexts")
        with progress_bar(sum(t.context_tokens for t in todo), "ingest") as bar:
            ingest_tasks(lm, st, todo, on_progress=bar.update)
    labels = [v.strip() for v in versions.split(",") if v.strip()] if versions else default_labels(st, items)
    with progress_bar(len(items) * (len(labels) + ("full" not in labels)), "eval", unit="task") as bar:
        result = evaluate_tasks(lm, st, labels, items, max_new_tokens=max_new_tokens, on_step=bar.update)
    if plot:
        from ..evaluation.plot import plot_quality_vs_bytes

        plot_quality_vs_bytes(result, plot)
        message(f"wrote {plot}")
    if as_json:
        emit_json(result)
        return
    print(format_table(result))
    if any(v.get("paired_vs_full") for v in result["versions"]):
        from ..evaluation.paired import paired_text

        print("\npaired with the full cache on the same tasks (answers lost/gained, exact McNemar p; "
              "paired-bootstrap 95% intervals of the ratios):")
        print(paired_text(result))


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_versions)
