"""`kdnctl compress`: prune and/or quantize stored versions into new labelled versions."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import (JsonOpt, ModelOpt, RayOpt, StoreOpt, check_name, emit_json, load_lm, message,
                     open_store, progress_bar)


def compress(
    docs: Optional[List[str]] = typer.Argument(None, help="Document ids (default: every document)."),
    budget: Optional[float] = typer.Option(None, "--budget", "-b", help="Size cap: stored bytes <= B x the fp16 K/V size, everything included (default 0.25 unless --keep is given alone). The new version is named bB (b0.25)."),
    keep: Optional[float] = typer.Option(None, "--keep", "-k", help="Fraction of tokens kept per layer and KV head, 0 < K <= 1 (alone: token eviction without a size cap)."),
    quant: Optional[str] = typer.Option(None, "--quant", "-q", help="With --budget: auto (default: the method measured best for the budget, see docs/compression.md) | ec (per-channel steps, entropy-coded) | uniform | floor | ladder | int8 | int4 | int3 | int2 | fp16 (eviction alone). With --keep alone: none | int8 | int4 | int3 | int2 | fp8 | mixed."),
    method: Optional[str] = typer.Option(None, "--press", "--method", "-m", help="The press that selects the kept tokens (default kvcrush; see `kdnctl methods`)."),
    scorer: Optional[str] = typer.Option(None, "--scorer", help="How the press ranks tokens (default: the budget's own; see `kdnctl methods`)."),
    option: Optional[List[str]] = typer.Option(None, "--option", "-o", help="KEY=VALUE, repeatable: protect, allocator, group_size, seed, the press's and the allocator's settings, and the experimental options (docs/compression.md lists them)."),
    source: str = typer.Option("full", "--from", help="Source version name."),
    label: Optional[str] = typer.Option(None, "--label", help="Name of the new version (default bB for a budget's own recipe)."),
    recipe_file: Optional[Path] = typer.Option(None, "--recipe", help="TOML recipe with a \\[compress] step."),
    store: Optional[Path] = StoreOpt,
    model: Optional[str] = ModelOpt,
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Model dtype for the steps that run it: float32 (CPU default), float16, bfloat16."),
    device: Optional[str] = typer.Option(None, "--device", help="Where the model runs: cpu or cuda (default: cuda when available)."),
    ray: Optional[str] = RayOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Compress stored KV into a new version: a size budget filled by precision first (default), or token eviction (--keep)."""
    from ..compress.document import CompressRecipe, compress_document

    workers, batch = None, 16
    if recipe_file is not None:
        from ..recipes import load_recipe

        recipe = load_recipe(recipe_file).compress_recipe()
        label = label or load_recipe(recipe_file).label
    else:
        if keep is not None and not 0 < keep <= 1:
            from ..errors import UsageError

            raise UsageError(f"keep must be in (0, 1], got {keep}", param="keep")
        if budget is None and keep is None:
            budget = 0.25  # the default: a size budget filled by precision first
        given = {"budget": budget, "keep": keep, "quant": quant, "press": method, "scorer": scorer}
        settings = {k: v for k, v in given.items() if v is not None}
        if budget is None:
            settings["budget"] = None  # --keep alone: token eviction
        extra = parse_options(option or [])
        workers, batch = extra.pop("workers", None), extra.pop("batch", 16)
        for name in ("protect", "allocator", "group_size", "seed"):  # recipe fields without a flag of their own
            if name in extra:
                settings[name] = extra.pop(name)
        recipe = CompressRecipe.from_dict({**settings, "options": extra})
    if workers is not None and ray is None:
        from ..errors import UsageError

        raise UsageError("the workers option sets how many Ray workers compress", hint="add --ray ADDRESS|local",
                         param="option")
    check_name("label", label or recipe.default_label(), "--label",
               hint=None if label else "the recipe's own name is too long: name the version with --label NAME")
    check_name("label", source, "--from")
    st = open_store(store)
    doc_ids = list(docs) if docs else [d.doc_id for d in st.list_documents()]
    if ray is not None:
        from ..distributed.compress import compress_on_ray

        with progress_bar(len(doc_ids), "compress", unit="doc") as bar:
            results = compress_on_ray(st, doc_ids, recipe, source=source, label=label, address=ray, workers=workers,
                                      model=model, batch_size=batch,
                                      on_result=lambda r: bar.update(1))
    else:
        # h2o / adaptive selections read `accum`, which ingest records only with --stats all; with the
        # model at hand compress computes it when a version lacks it.
        evicts = recipe.keep < 1 or (recipe.budget is not None and recipe.budget < 1)
        accum_press = recipe.scorer == "accum" or (evicts and (recipe.press == "h2o" or recipe.allocator == "adaptive"))
        lm = load_lm(model, dtype=dtype, device=device, compresses=True) if recipe.needs_model or accum_press else None
        fingerprint = lm.fingerprint if lm is not None else None
        results = []
        with st.writer(), progress_bar(len(doc_ids), "compress", unit="doc") as bar:
            for doc_id in doc_ids:
                results.append(compress_document(st, doc_id, recipe, lm=lm, source=source, label=label,
                                                 fingerprint=fingerprint))
                bar.set_postfix_str(f"{doc_id} {results[-1].status} in {results[-1].seconds:.1f} s")
                bar.update(1)
    rows = [{"doc": r.doc_id, "label": r.label, "status": r.status, "source_bytes": r.source_bytes,
             "bytes": r.bytes, "ratio": round(r.ratio, 2), "seconds": round(r.seconds, 3),
             "score_seconds": round(r.score_seconds, 3), "fp16_bytes": r.fp16_bytes,
             "fraction_of_fp16": round(r.fraction_of_fp16, 4), "kept": round(r.kept, 4), "mix": r.mix}
            for r in results]
    if as_json:
        emit_json({"results": rows})
        return
    for r in rows:
        frac = f", {r['fraction_of_fp16']:.1%} of fp16" if r["fp16_bytes"] else ""
        kept = f", {r['kept']:.0%} of tokens kept" if r["status"] == "compressed" and r["kept"] < 1 else ""
        message(f"{r['doc']}: {r['label']} {r['status']}, {r['source_bytes'] / 1e6:.1f} MB -> {r['bytes'] / 1e6:.2f} MB ({r['ratio']}x{frac}{kept})")


def parse_options(pairs: list[str]) -> dict:
    """``--option KEY=VALUE`` pairs -> {KEY: value}; the recipe checks each key and value
    (``CompressRecipe.from_dict``); ``workers`` and ``batch`` set how ``--ray`` runs."""
    from ..compress.options import parse_value
    from ..errors import UsageError

    out = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not key:
            raise UsageError(f"--option takes KEY=VALUE, got {pair!r}", hint="e.g. --option protect=64", param="option")
        out[key] = parse_value(value)
    for key in ("workers", "batch"):
        if key in out and (isinstance(out[key], bool) or not isinstance(out[key], int) or out[key] < 1):
            raise UsageError(f"option {key} must be a whole number >= 1, got {out[key]!r}", param="option")
    return out


def methods() -> None:
    """List pruning methods, allocators, scorers, quantizers and the compress pipelines' stages."""
    from ..allocate import ALLOCATORS
    from ..compress.stages import PIPELINES
    from ..presses import PRESSES
    from ..quant import QUANTIZERS
    from ..scorers import SCORERS

    print("methods:    " + " ".join(PRESSES))
    print("allocators: " + " ".join(ALLOCATORS))
    print("scorers:    " + " ".join(SCORERS))
    print("quantizers: " + " ".join(QUANTIZERS))
    for name, stages in PIPELINES.items():
        print(f"pipeline {name}: " + " -> ".join(stages))


def register(app: typer.Typer) -> None:
    app.command("compress")(compress)
    app.command("methods")(methods)
