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
    max_new_tokens: int = typer.Option(40, "--max-new-tokens"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a quality-vs-budget plot (PNG)."),
    store: Optional[Path] = StoreOpt,
    model: Optional[str] = ModelOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Accuracy, answer NLL, KL vs full, bytes/token and compression ratio per version."""
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
                          max_new_tokens=max_new_tokens, on_step=bar.update)
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


def register(app: typer.Typer) -> None:
    app.command("eval")(eval_versions)
