"""`kdnctl run RECIPE PATH...`: ingest, then every step of the recipe, skipping what is done."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import JsonOpt, ModelOpt, StoreOpt, doc_done, emit_json, load_lm, message, open_store, progress_bar


def run(
    recipe_file: Path = typer.Argument(..., help="TOML recipe (see recipes/)."),
    paths: List[Path] = typer.Argument(..., help="Files or directories to ingest."),
    store: Optional[Path] = StoreOpt,
    model: Optional[str] = ModelOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Run a recipe end to end on PATHS."""
    from ..compress.document import compress_document
    from ..ingest.corpus import read_corpus
    from ..errors import UsageError
    from ..ingest import ingest_documents
    from ..recipes import load_recipe

    recipe = load_recipe(recipe_file)
    opts = recipe.ingest_options()
    compress = recipe.compress_recipe() if recipe.compress else None
    docs, skipped = read_corpus(paths)
    for s in skipped:
        message(f"warning: skipped {s.path}: {s.reason}")
    if not docs:
        raise UsageError("no readable documents in the given paths")
    st = open_store(store, create=True)
    lm = load_lm(model, compresses=True)
    total = sum(len(lm.tokenizer(d.text, add_special_tokens=False).input_ids) for d in docs)
    with progress_bar(total, "ingest") as bar:
        report = ingest_documents(st, lm, docs, opts, on_progress=bar.update, on_doc=doc_done("ingest"))
    out = {"recipe": recipe.name, "ingest": report.as_dict(), "compress": []}
    doc_ids = report.ingested + report.unchanged
    if compress is not None:
        with st.writer(), progress_bar(len(doc_ids), "compress", unit="doc") as bar:
            for doc_id in doc_ids:
                r = compress_document(st, doc_id, compress, lm=lm, label=recipe.label, fingerprint=lm.fingerprint)
                out["compress"].append({"doc": doc_id, "label": r.label, "status": r.status,
                                        "ratio": round(r.ratio, 2), "seconds": round(r.seconds, 3)})
                bar.set_postfix_str(f"{doc_id} {r.status} in {r.seconds:.1f} s")
                bar.update(1)
    if recipe.edit:
        message("note: [edit] steps run through `kdnctl edit`; see docs/steering.md")
    if as_json:
        emit_json(out)
        return
    message(f"ingest: {len(report.ingested)} new, {len(report.unchanged)} unchanged ({report.tokens_per_s:.0f} tok/s)")
    for c in out["compress"]:
        message(f"{c['doc']}: {c['label']} {c['status']} ({c['ratio']}x smaller)")


def register(app: typer.Typer) -> None:
    app.command("run")(run)
