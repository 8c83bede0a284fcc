"""`kdnctl ask`: answer a question from stored KV (optionally against a full prefill)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from .common import JsonOpt, ModelOpt, StoreOpt, emit_json, load_lm, message, open_store


def ask(
    doc: str = typer.Argument(..., help="Document id (see `kdnctl ls`)."),
    question: str = typer.Argument(..., help="The question."),
    version: str = typer.Option("full", "--version", "-v", help="Version label to load."),
    compare: bool = typer.Option(False, "--compare", help="Also run a fresh full prefill and time it."),
    max_new_tokens: int = typer.Option(48, "--max-new-tokens"),
    store: Optional[Path] = StoreOpt,
    model: Optional[str] = ModelOpt,
    remote: Optional[str] = typer.Option(None, "--remote", help="Read bundles from a `kdnctl serve-files` URL."),
    token_file: Optional[Path] = typer.Option(None, "--token-file", help="Bearer token for --remote."),
    as_json: bool = JsonOpt,
) -> None:
    """Answer QUESTION about DOC from its stored KV cache."""
    from ..engine.hf import full_prefill_generate, generate, load_document
    from ..prompting import PromptFormat

    lm = load_lm(model)
    if remote:
        from ..client import RemoteStore

        st = RemoteStore(remote, token=token_file.read_text().strip() if token_file else None)
    else:
        st = open_store(store)
    suffix = PromptFormat.for_tokenizer(lm.tokenizer).question_ids(lm.tokenizer, question)
    t0 = time.perf_counter()
    ctx = load_document(lm, st, doc, version)
    result = generate(lm, ctx, suffix, max_new_tokens=max_new_tokens, t0=t0)
    out = {"answer": result.answer, "ttft_s": round(result.ttft_s, 4), "context_tokens": ctx.n_tokens,
           "label": version, "kept_tokens": round(ctx.kept_tokens, 1), "bundle_bytes": ctx.nbytes}
    if compare:
        full = full_prefill_generate(lm, ctx.token_ids, suffix, max_new_tokens=max_new_tokens)
        out["full"] = {"answer": full.answer, "ttft_s": round(full.ttft_s, 4)}
    if as_json:
        emit_json(out)
        return
    print(result.answer)
    message(f"ttft {result.ttft_s:.3f}s from stored KV [{version}], {ctx.n_tokens} context tokens")
    if compare:
        speedup = full.ttft_s / result.ttft_s if result.ttft_s else float("inf")
        message(f"full prefill: ttft {full.ttft_s:.3f}s ({speedup:.1f}x slower), answer: {full.answer}")


def register(app: typer.Typer) -> None:
    app.command("ask")(ask)
