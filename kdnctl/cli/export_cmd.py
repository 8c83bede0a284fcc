"""`kdnctl export lmcache|llama-cpp`: write stored KV in an inference engine's own format."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import JsonOpt, ModelOpt, StoreOpt, emit_json, load_lm, message, open_store

export_app = typer.Typer(help="Write stored KV in an engine's own format (see docs/engines.md).", no_args_is_help=True)


@export_app.command("lmcache")
def lmcache(
    docs: Optional[List[str]] = typer.Argument(None, metavar="[DOC...]", help="Document ids (default: every document)."),
    to: Path = typer.Option(..., "--to", help="Directory LMCache's fs connector reads (base_path)."),
    version: str = typer.Option("full", "--version", "-v", help="Version label: full or a quantization-only version."),
    model_name: str = typer.Option("HuggingFaceTB/SmolLM2-135M-Instruct", "--model-name", help="The model name vLLM serves (its --model)."),
    dtype: str = typer.Option("fp16", "--dtype", help="Engine KV dtype: fp16 | bf16."),
    chunk_size: int = typer.Option(256, "--chunk-size", help="LMCache chunk_size (only 256, LMCache's, is accepted)."),
    hash_algorithm: str = typer.Option("sha256_cbor", "--hash", help="sha256_cbor (vLLM installed, the deployment) | builtin (LMCache without vLLM)."),
    hash_seed: str = typer.Option("0", "--hash-seed", help="PYTHONHASHSEED the engine runs with."),
    none_hash: Optional[int] = typer.Option(None, "--none-hash", help="Override the chain's initial hash (default: what LMCache computes)."),
    world_size: int = typer.Option(1, "--world-size", help="Tensor-parallel workers (KV heads are split across them)."),
    check: bool = typer.Option(False, "--check", help="Read every file back with LMCache's own code (needs kdnctl\\[lmcache])."),
    store: Optional[Path] = StoreOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Write LMCache FSConnector files for every full chunk, plus manifest.json."""
    from ..export.lmcache import HashSettings, check_with_lmcache, export_lmcache

    settings = HashSettings(hash_algorithm, hash_seed, none_hash)
    st = open_store(store)
    doc_ids = list(docs) if docs else [d.doc_id for d in st.list_documents()]
    res = export_lmcache(st, doc_ids, to, label=version, model_name=model_name, dtype=dtype,
                         chunk_size=chunk_size, hash_settings=settings, world_size=world_size)
    found = check_with_lmcache(res) if check else None
    if as_json:
        emit_json({"directory": str(to), "files": res.n_files, "bytes": res.n_bytes,
                   "skipped": res.skipped, "checked_chunks": found, "manifest": res.manifest})
        return
    for d in res.manifest["documents"]:
        message(f"{d['doc_id']} [{d['label']}]: {len(d['chunks'])} chunks of {res.manifest['chunk_size']} tokens "
                f"({d['n_tokens']} tokens)")
    message(f"wrote {res.n_files} files, {res.n_bytes / 1e6:.1f} MB, manifest {to / 'manifest.json'}")
    if found is not None:
        message(f"LMCache found and read back {found} chunks")


@export_app.command("llama-cpp")
def llama_cpp(
    doc: str = typer.Argument(..., metavar="DOC", help="Document id."),
    to: Path = typer.Option(..., "--to", help="Sequence state file to write (a FILE.json sidecar goes beside it)."),
    version: str = typer.Option("full", "--version", "-v", help="Version label (pruned: one token set for all heads and layers)."),
    kv_type: str = typer.Option("f16", "--kv-type", help="llama.cpp KV cache type: f16 | q8_0."),
    flash_attn: Optional[bool] = typer.Option(None, "--flash-attn/--no-flash-attn", help="The context's flash attention (default: off for f16, on for q8_0)."),
    kv_rotation: bool = typer.Option(True, "--kv-rotation/--no-kv-rotation", help="q8_0: Hadamard-rotate K/V as llama.cpp (attn_rot, default since PR 21038) does; off for older builds or LLAMA_ATTN_ROT_DISABLE=1."),
    gguf: Optional[str] = typer.Option(None, "--gguf", help="GGUF llama.cpp loads (default: the default model's)."),
    check: bool = typer.Option(False, "--check", help="Load the file with llama.cpp's own code and decode a question after it (needs kdnctl\\[llamacpp])."),
    store: Optional[Path] = StoreOpt,
    model: Optional[str] = ModelOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Write a llama.cpp sequence state file for DOC's stored KV."""
    from ..export.llamacpp import export_llamacpp, gguf_for_model
    from ..models.load import resolve_model_path
    from ..ingest.prompting import QUESTION_TEMPLATE, PromptFormat

    gguf_path = resolve_model_path(gguf) if gguf else gguf_for_model(resolve_model_path(model))
    if check:
        from ..export.base import require_engine

        require_engine("llama_cpp", "llamacpp", "--check")
    lm = load_lm(model if model is not None else str(gguf_path))  # the model the document was ingested with
    fmt = PromptFormat.for_tokenizer(lm.tokenizer)
    suffix = QUESTION_TEMPLATE + fmt.tail
    res = export_llamacpp(open_store(store), doc, to, label=version, gguf=gguf_path, kv_type=kv_type,
                          flash_attn=flash_attn, fingerprint=lm.fingerprint, suffix_template=suffix,
                          kv_rotation=kv_rotation)
    loaded = None
    if check:
        from ..export.llamacpp_engine import LlamaCppRunner

        with LlamaCppRunner(gguf_path, n_ctx=res.info["n_past"] + 512, kv_type=kv_type,
                            flash_attn=res.info["flash_attn"]) as runner:
            loaded = runner.load_state(res.path)
            runner.decode(fmt.question_ids(lm.tokenizer, "What is this about?"), loaded)  # llama.cpp accepts what follows
    if as_json:
        emit_json({"file": str(res.path), "sidecar": str(res.sidecar), "bytes": res.n_bytes,
                   "checked_cells": loaded, **res.info})
        return
    message(f"{doc} [{version}]: {res.info['n_cells']} cells of {res.info['n_past']} tokens, "
            f"{res.n_bytes / 1e6:.1f} MB -> {res.path} (next position {res.info['n_past']}; see {res.sidecar})")
    if loaded is not None:
        message(f"llama.cpp loaded the state ({loaded} tokens) and decoded a question after it")


def register(app: typer.Typer) -> None:
    app.add_typer(export_app, name="export")
