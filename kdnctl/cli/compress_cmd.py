"""`kdnctl compress`: prune and/or quantize stored versions into new labelled versions."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import (BatchOpt, JsonOpt, ModelOpt, RayOpt, StoreOpt, WorkersOpt, check_name, emit_json, load_lm, message,
                     open_store, progress_bar)


def compress(
    docs: Optional[List[str]] = typer.Argument(None, help="Document ids (default: every document)."),
    budget: Optional[float] = typer.Option(None, "--budget", "-b", help="Size cap: stored bytes <= B x the fp16 K/V size, everything included (default 0.25 unless --keep is given alone)."),
    keep: Optional[float] = typer.Option(None, "--keep", "-k", help="Token eviction: fraction of tokens kept per layer and KV head, 0 < K <= 1."),
    method: str = typer.Option("kvcrush", "--method", "-m", help="Pruning method (see `kdnctl methods`)."),
    allocator: str = typer.Option("uniform", "--allocator", help="Per-layer budget split: uniform | pyramid | adaptive (pyramid:METHOD as --method also works)."),
    quant: Optional[str] = typer.Option(None, "--quant", "-q", help="With --budget: auto (default: ec from 0.25 to where int8 holds every token, ~0.54; below 0.25 ec with eviction first, half of the tokens kept at 0.083 (every token at 0.25, the share interpolated between, proportional below) as whole sentences ranked by sentences-gap, their values refitted to the keys as decoded and rounded with feedback (--refit 0.01 --refit-hold --refit-decoded --refit-feedback); else uniform) | uniform (the best single tier that fits) | floor (that tier + one-tier upgrades) | ladder (per-token tiers) | ec (per-channel steps weighted by attention, entropy-coded; every token kept unless --keep evicts first, one token set for all layers and heads) | int8 | int4 | int3 | int2 | fp16 (eviction alone). With --keep alone: none | int8 | int4 | int3 | int2 | fp8 | mixed."),
    scorer: Optional[str] = typer.Option(None, "--scorer", help="window | accum | surprisal | reconstruct | hybrid | sentences | sentences-local | sentences-gap | literals (default hybrid; sentences-gap where --quant auto evicts; literals: digits first, for --lift)."),
    group_size: int = typer.Option(32, "--group-size", help="Quantization group size."),
    kvcrush_ratio: Optional[float] = typer.Option(None, "--kvcrush-ratio", help="Share of the budget for KVCrush representatives."),
    anchor: Optional[str] = typer.Option(None, "--anchor", help="KVCrush anchor: random | mean | alternate."),
    page_size: Optional[int] = typer.Option(None, "--page-size", help="KVCrush page size (1 = token level)."),
    protect: Optional[int] = typer.Option(None, "--protect", help="With --budget: the last N tokens (and the prompt header) are never evicted and get precision first."),
    lift: Optional[str] = typer.Option(None, "--lift", help="With --budget floor/ladder/ec: a second scorer whose top tokens also get precision first (ec: the top quarter at 2x finer steps, see --lift-share/--lift-level/--lift-role; e.g. sentences, surprisal). The auto recipe's ec lifts the keys of the top 30% by literals 4x; none turns that off."),
    lift_share: Optional[float] = typer.Option(None, "--lift-share", help="With --quant ec --lift S: the share of the kept tokens lifted (default 0.25)."),
    lift_level: Optional[int] = typer.Option(None, "--lift-level", help="With --quant ec --lift S: the lifted tokens' steps are 2**N finer, N 1 to 4 (default 1)."),
    lift_role: Optional[str] = typer.Option(None, "--lift-role", help="With --quant ec --lift S: keys lifts the keys alone (the values keep their steps); default both."),
    key_weight: Optional[float] = typer.Option(None, "--key-weight", help="With --budget: a key error's damage relative to a value error's: floor/ladder's solver picks upgrades by it, ec's key steps are 1/sqrt(W) of theirs (default 1)."),
    layers: Optional[str] = typer.Option(None, "--layers", help="With --quant ec: fisher (each layer's and role's steps scaled by a Fisher estimate of what its error costs; the default where every token is kept) | even (the same relative error everywhere; the default with eviction)."),
    backfill: Optional[str] = typer.Option(None, "--backfill", help="With --quant ec --keep K: layers A-B, layers A+B or KV heads L.H (e.g. 12-23, 18+20, 18.2+20.1) also keep the evicted tokens, at steps 2**S coarser than the kept ones' (S: --backfill-shift)."),
    backfill_shift: Optional[int] = typer.Option(None, "--backfill-shift", help="With --backfill: S from 0 to 4 (default 3), the evicted tokens' steps are 2**S x the kept ones'."),
    backfill_key_shift: Optional[int] = typer.Option(None, "--backfill-key-shift", help="With --backfill: the keys' own S, 0 to 4 (default: --backfill-shift's); e.g. 0 keeps the evicted keys as fine as the kept ones."),
    key_basis: Optional[str] = typer.Option(None, "--key-basis", help="With --quant ec: auto (default: the model's key basis where one is registered, as for the default model) | model (require one) | none (keys in channels). A key basis codes keys in the model's principal axes, calibrated once per model on other text: ~16% fewer key bytes at the same error, so finer steps at the same budget."),
    refit: Optional[float] = typer.Option(None, "--refit", help="With --quant ec --keep K: refit the kept tokens' values so that the document's own queries, placed after it, read the full cache's attention output; the ridge weight (e.g. 0.01; 0: off). The auto recipe below 0.25 refits with 0.01, --refit-hold, --refit-decoded and --refit-feedback (sessions 39-40, docs/compression.md); unheld, at 0.083 it lowers continuation NLL but loses needles and facts."),
    refit_hold: bool = typer.Option(False, "--refit-hold", help="With --refit and a --lift (the auto recipe's): the tokens the lift lifts (the digits and their sentences) keep their values; the fit moves the others' (the auto recipe below 0.25 does this)."),
    refit_decoded: bool = typer.Option(False, "--refit-decoded", help="With --refit: fit the values to the kept keys as the loader will decode them (quantized at a first fit of the budget), not to the keys before quantization; one more sizing pass (the auto recipe below 0.25 does this)."),
    refit_feedback: bool = typer.Option(False, "--refit-feedback", help="With --refit: round the refitted values to ec's grid token by token, each rounding error carried into the chunk's tokens not yet rounded through the fit's normal matrix (optimal-brain-quantization style); same bytes (the auto recipe below 0.25 does this)."),
    protect_level: Optional[int] = typer.Option(None, "--protect-level", help="With --quant ec: the prompt header and the last --protect tokens get steps 2**N finer, N from 0 to 2 (default 2)."),
    tail_reads: Optional[float] = typer.Option(None, "--tail-reads", help="With --quant ec --keep K: the share R of the kept tokens (beyond the header and the last --protect) chosen as whole sentences by what the document's last 128 queries attend to in the middle layers, the rest by --scorer: the sources the text after the document copies from (docs/compression.md)."),
    seed: int = typer.Option(0, "--seed"),
    source: str = typer.Option("full", "--from", help="Source version label."),
    label: Optional[str] = typer.Option(None, "--label", help="Label of the new version (default from the recipe)."),
    recipe_file: Optional[Path] = typer.Option(None, "--recipe", help="TOML recipe with a \\[compress] step."),
    store: Optional[Path] = StoreOpt,
    model: Optional[str] = ModelOpt,
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Model dtype for scorers that run it: float32 (CPU default), float16, bfloat16."),
    device: Optional[str] = typer.Option(None, "--device", help="Where scorers run the model: cpu or cuda (default: cuda when available)."),
    ray: Optional[str] = RayOpt,
    workers: Optional[int] = WorkersOpt,
    batch: int = BatchOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Compress stored KV into a new version: a size budget filled by precision first (default), or token eviction (--keep)."""
    from ..compress import CompressRecipe, compress_document

    if recipe_file is not None:
        from ..recipes import load_recipe

        recipe = load_recipe(recipe_file).compress_recipe()
        label = label or load_recipe(recipe_file).label
    else:
        opts = {k: v for k, v in {"ratio": kvcrush_ratio, "anchor": anchor, "page_size": page_size}.items() if v is not None}
        if keep is not None and not 0 < keep <= 1:
            from ..errors import UsageError

            raise UsageError(f"keep must be in (0, 1], got {keep}", param="keep")
        if budget is None and keep is None:
            budget = 0.25  # the default: a size budget filled by precision first
        recipe = CompressRecipe(budget=budget, keep=keep if keep is not None else 1.0, method=method,
                                scorer=scorer, quant=quant, group_size=group_size, seed=seed,
                                method_options=opts, allocator=allocator, protect=protect or 0, lift=lift, layers=layers,
                                backfill=backfill,
                                **({"backfill_shift": backfill_shift} if backfill_shift is not None else {}),
                                **({"backfill_key_shift": backfill_key_shift} if backfill_key_shift is not None else {}),
                                **({"key_weight": key_weight} if key_weight is not None else {}),
                                **({"key_basis": key_basis} if key_basis is not None else {}),
                                **({"refit": refit} if refit is not None else {}),
                                **({"refit_hold": True} if refit_hold else {}),
                                **({"refit_decoded": True} if refit_decoded else {}),
                                **({"refit_feedback": True} if refit_feedback else {}),
                                **({"protect_level": protect_level} if protect_level is not None else {}),
                                **({"tail_reads": tail_reads} if tail_reads is not None else {}),
                                **({"lift_share": lift_share} if lift_share is not None else {}),
                                **({"lift_level": lift_level} if lift_level is not None else {}),
                                **({"lift_role": lift_role} if lift_role is not None else {}))
    check_name("label", label or recipe.default_label(), "--label")
    check_name("label", source, "--from")
    st = open_store(store)
    doc_ids = list(docs) if docs else [d.doc_id for d in st.list_documents()]
    if ray is not None:
        from ..distributed.compress import compress_on_ray

        with progress_bar(len(doc_ids), "compress", unit="doc") as bar:
            results = compress_on_ray(st, doc_ids, recipe, source=source, label=label, address=ray, workers=workers,
                                      model=model, batch_size=batch,
                                      on_result=lambda r: bar.update(1))
    elif workers is not None:
        from ..errors import UsageError

        raise UsageError("--workers needs --ray ADDRESS|local")
    else:
        # h2o / adaptive budgets read `accum`, which ingest records only with --stats all; with the
        # model at hand compress computes it when a version lacks it.
        evicts = (recipe.budget if recipe.budget is not None else recipe.keep) < 1
        accum_press = recipe.scorer == "accum" or (evicts and (recipe.method == "h2o" or recipe.allocator == "adaptive"))
        lm = load_lm(model, dtype=dtype, device=device) if recipe.needs_model or accum_press else None
        fingerprint = lm.fingerprint if lm is not None else None
        results = []
        with st.writer(), progress_bar(len(doc_ids), "compress", unit="doc") as bar:
            for doc_id in doc_ids:
                results.append(compress_document(st, doc_id, recipe, lm=lm, source=source, label=label,
                                                 fingerprint=fingerprint))
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


def methods() -> None:
    """List pruning methods, allocators, scorers and quantizers."""
    from ..allocate import ALLOCATORS
    from ..presses import PRESSES
    from ..quant import QUANTIZERS
    from ..scoring import SCORERS

    print("methods:    " + " ".join(PRESSES))
    print("allocators: " + " ".join(ALLOCATORS))
    print("scorers:    " + " ".join(SCORERS))
    print("quantizers: " + " ".join(QUANTIZERS))


def register(app: typer.Typer) -> None:
    app.command("compress")(compress)
    app.command("methods")(methods)
