"""`kdnctl ask`: answer a question from stored KV (optionally against a full prefill).

Forms:
  kdnctl ask DOC QUESTION                      the document's stored prefix cache (--version)
  kdnctl ask DOC QUESTION --version independent  all of DOC's independent chunks, composed
  kdnctl ask --chunks DOC#0,DOC#3 QUESTION     chosen independent chunks, composed
  kdnctl ask --retrieve K QUESTION             the K best BM25 chunks, composed (DOC limits the search)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kdnctl.models.load import LoadedModel

import threading
import time
from pathlib import Path
from typing import Optional

import typer

from .common import JsonOpt, ModelOpt, StoreOpt, emit_json, load_lm, message, open_store


def ask(
    doc: Optional[str] = typer.Argument(None, metavar="DOC", help="Document id (see `kdnctl ls`); optional with --chunks/--retrieve."),
    question: Optional[str] = typer.Argument(None, metavar="QUESTION", help="The question."),
    version: str = typer.Option("full", "--version", "-v", help="Version label to load."),
    chunks: Optional[str] = typer.Option(None, "--chunks", help="Compose these independent chunks: DOC#INDEX or content-hash prefixes, comma-separated."),
    retrieve: Optional[int] = typer.Option(None, "--retrieve", help="Compose the K independent chunks that best match the question (BM25)."),
    recompute: float = typer.Option(0.15, "--recompute", help="Fraction of composed chunk tokens to recompute (0 = plain concatenation, 1 = full prefill)."),
    compare: bool = typer.Option(False, "--compare", help="Also run a fresh full prefill and time it."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens"),
    store: Optional[Path] = StoreOpt,
    model: Optional[str] = ModelOpt,
    remote: Optional[str] = typer.Option(None, "--remote", help="Read bundles from a `kdnctl serve-files` URL."),
    token_file: Optional[Path] = typer.Option(None, "--token-file", help="Bearer token for --remote."),
    as_json: bool = JsonOpt,
) -> None:
    """Answer QUESTION about DOC from its stored KV cache (or from composed independent chunks)."""
    from ..errors import UsageError
    from ..ingest.prompting import PromptFormat

    composing = chunks is not None or retrieve is not None
    if question is None and composing:
        doc, question = None, doc
    if question is None or doc is None and not composing:
        raise UsageError("missing QUESTION" if doc is not None or composing else "missing DOC and QUESTION",
                         hint="kdnctl ask DOC QUESTION, or kdnctl ask --chunks ID,ID QUESTION / --retrieve K QUESTION")
    if chunks is not None and retrieve is not None:
        raise UsageError("use either --chunks or --retrieve, not both")
    if not 0.0 <= recompute <= 1.0:
        raise UsageError(f"--recompute must be in [0, 1], got {recompute}")
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")

    if remote:
        from ..store.client import RemoteStore

        st = RemoteStore(remote, token=token_file.read_text().strip() if token_file else None)
    else:
        st = open_store(store)
    picked = None
    if chunks is not None or (not composing and version == "independent"):
        picked = _pick_chunks(st, doc, chunks)  # before loading the model: bad ids fail fast
    from ..quant import ec_batch

    # the compiled decoder of compressed versions loads (from numba's disk cache) while the model
    # does, not inside the time to first token
    threading.Thread(target=ec_batch.enabled, daemon=True).start()
    lm = load_lm(model)
    suffix = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, question)
    if not composing and version != "independent":
        _ask_document(lm, st, doc, version, suffix, compare, max_new_tokens, as_json)
    else:
        _ask_composed(lm, st, doc, question, picked, retrieve, recompute, suffix, compare, max_new_tokens, as_json)


def _pick_chunks(st, doc, chunks):
    from ..engine.retrieval import list_chunks, resolve_chunks

    if chunks is not None:
        return resolve_chunks(st, chunks.split(","), doc_id=doc)
    picked = list_chunks(st, doc_id=doc)  # DOC --version independent: every chunk, in order
    if not picked:
        from ..errors import NotFoundError

        raise NotFoundError(f"document {doc!r} has no independent version",
                            hint=f"kdnctl ingest --mode independent {doc}")
    return picked


def _ask_document(lm: LoadedModel, st, doc, version, suffix, compare, max_new_tokens, as_json) -> None:
    from ..engine.hf import full_prefill_generate, generate, load_document

    t0 = time.perf_counter()
    ctx = load_document(lm, st, doc, version, overlap=True)  # the decode of the last layers behind the first layers' forward
    result = generate(lm, ctx, suffix, max_new_tokens=max_new_tokens, t0=t0)
    out = {"answer": result.answer, "ttft_s": round(result.ttft_s, 4), "context_tokens": ctx.n_tokens,
           "label": version, "kept_tokens": round(ctx.kept_tokens, 1), "bundle_bytes": ctx.nbytes}
    full = None
    if compare:
        full = full_prefill_generate(lm, ctx.token_ids, suffix, max_new_tokens=max_new_tokens)
        out["full"] = {"answer": full.answer, "ttft_s": round(full.ttft_s, 4)}
    _report(out, result, full, as_json, f"from stored KV [{version}], {ctx.n_tokens} context tokens")


def _ask_composed(lm: LoadedModel, st, doc, question, picked, retrieve, recompute, suffix, compare, max_new_tokens, as_json) -> None:
    from ..engine.hf import full_prefill_generate, generate
    from ..engine.retrieval import compose_chunks
    from ..engine.retrieval import retrieve as bm25_retrieve

    t0 = time.perf_counter()
    if picked is None:
        picked = bm25_retrieve(st, question, retrieve, doc_id=doc, fingerprint=lm.fingerprint)
    info: dict = {}
    ctx = compose_chunks(lm, st, picked, suffix, recompute, info=info)
    result = generate(lm, ctx, suffix, max_new_tokens=max_new_tokens, t0=t0)
    out = {"answer": result.answer, "ttft_s": round(result.ttft_s, 4), "context_tokens": ctx.n_tokens,
           "label": "composed", "chunks": [c.as_dict() for c in picked], "recompute": recompute,
           "recomputed_tokens": info.get("recomputed_tokens", 0), "load_s": round(ctx.load_s, 4),
           "compose_s": info.get("compose_s"), "bundle_bytes": ctx.nbytes}
    full = None
    if compare:
        full = full_prefill_generate(lm, ctx.token_ids, suffix, max_new_tokens=max_new_tokens)
        out["full"] = {"answer": full.answer, "ttft_s": round(full.ttft_s, 4)}
    ids = ", ".join(c.id for c in picked)
    _report(out, result, full, as_json,
            f"from {len(picked)} composed chunk(s) [{ids}], {ctx.n_tokens} context tokens, "
            f"{info.get('recomputed_tokens', 0)} recomputed")


def _report(out: dict, result, full, as_json: bool, what: str) -> None:
    if as_json:
        emit_json(out)
        return
    print(result.answer)
    message(f"ttft {result.ttft_s:.3f}s {what}")
    if full is not None:
        speedup = full.ttft_s / result.ttft_s if result.ttft_s else float("inf")
        message(f"full prefill: ttft {full.ttft_s:.3f}s ({speedup:.1f}x slower), answer: {full.answer}")


def register(app: typer.Typer) -> None:
    app.command("ask")(ask)
