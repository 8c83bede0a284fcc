"""`kdnctl edit --steer`, `kdnctl steer profile` and `kdnctl eval-steer`: attention-steering edits."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import List, Optional

import typer

from ..errors import UsageError
from .common import JsonOpt, check_name, ModelOpt, StoreOpt, emit_json, load_lm, message, open_store, progress_bar

DEFAULT_TASKS = Path("examples/steering/tasks.jsonl")
DEFAULT_HEADS_OUT = Path("recipes/heads/smollm2-135m.json")

steer_app = typer.Typer(help="Attention-steering tools (head profiling).", no_args_is_help=True)


def edit(
    docs: List[str] = typer.Argument(..., help="Document ids to edit (see `kdnctl ls`)."),
    steer: List[str] = typer.Option(..., "--steer", help="Span to emphasise: TEXT | re:PATTERN | markers:FILE | lit:TEXT (repeatable)."),
    alpha: float = typer.Option(0.01, "--alpha", help="Attention scale outside the spans, 0 < alpha <= 1 (1 = no change)."),
    heads: str = typer.Option("auto", "--heads", help="auto | FILE (.json/.toml) | L:H,L:H,... (L:* = all heads of L)."),
    mode: str = typer.Option("bias", "--mode", help="bias (keep K/V, add bias) | reprefill (recompute K/V steered)."),
    source: str = typer.Option("full", "--from", help="Source version label."),
    label: Optional[str] = typer.Option(None, "--label", help="Label of the new version (default <from>+steer...)."),
    store: Optional[Path] = StoreOpt,
    model: Optional[str] = ModelOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Steer attention towards highlighted spans (PASTA) in a new version of each DOC."""
    from ..steer.base import SteerSpec, steer_document
    from ..steer.heads import resolve_heads

    check_name("label", label, "--label")
    check_name("label", source, "--from")
    st = open_store(store)  # a damaged store fails before the model loads
    lm = load_lm(model)
    head_map, heads_desc = resolve_heads(heads, lm)
    spec = SteerSpec(list(steer), head_map, alpha=alpha, mode=mode, heads_spec=heads_desc)
    results = []
    with st.writer(), progress_bar(len(docs), "steer", unit="doc") as bar:
        for doc_id in docs:
            results.append(steer_document(st, lm, doc_id, spec, source=source, label=label).as_dict())
            bar.update(1)
    if as_json:
        emit_json({"results": results, "alpha": spec.alpha, "mode": spec.mode, "heads": heads_desc,
                   "n_heads": sum(len(h) for h in head_map.values())})
        return
    for r in results:
        message(f"{r['doc']}: {r['label']} {r['status']} ({r['mode']}, {r['n_highlighted']}/{r['n_tokens']} tokens "
                f"highlighted, {len(head_map)} layers / {sum(len(h) for h in head_map.values())} heads)")


@steer_app.command("profile")
def profile(
    tasks: Path = typer.Option(DEFAULT_TASKS, "--tasks", help="Steering task set (JSONL)."),
    out: Path = typer.Option(DEFAULT_HEADS_OUT, "--out", help="Where to write the head config (JSON)."),
    alpha: float = typer.Option(0.01, "--alpha"),
    max_new_tokens: int = typer.Option(16, "--max-new-tokens", help="Answer length while profiling (short = cheap)."),
    top_layers: int = typer.Option(3, "--top-layers", help="Layers whose heads are profiled one by one."),
    model: Optional[str] = ModelOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Rank layers and heads by the accuracy gain of steering each alone; write a head config."""
    from ..evaluation.steering import load_tasks
    from ..steer.base import validate_alpha
    from ..steer.profile import profile_heads, write_config

    validate_alpha(alpha)
    if max_new_tokens < 1 or top_layers < 1:
        raise UsageError("--max-new-tokens and --top-layers must be >= 1")
    task_list = load_tasks(tasks)
    lm = load_lm(model)
    bars: dict[str, object] = {}

    def progress(stage: str, i: int, n: int) -> None:
        if stage not in bars:
            bars[stage] = progress_bar(n, stage, unit="task").__enter__()
        bars[stage].update(1)
        if i == n:
            bars.pop(stage).__exit__(None, None, None)

    config = profile_heads(lm, task_list, alpha=alpha, max_new_tokens=max_new_tokens, top_layers=top_layers,
                           on_progress=progress)
    path = write_config(config, out)
    p = config["profile"]
    if as_json:
        emit_json({"out": str(path), "heads": config["heads"], "baseline_accuracy": p["baseline_accuracy"],
                   "chosen_accuracy": p["chosen_accuracy"], "top_layers": p["top_layers"], "seconds": p["seconds"]})
        return
    message(f"wrote {path}: {len(config['heads'])} heads {config['heads']}")
    message(f"accuracy {p['baseline_accuracy']:.2f} unsteered -> {p['chosen_accuracy']:.2f} with the chosen heads "
            f"(top layers {p['top_layers']}, {p['seconds']:.0f}s)")


def eval_steer(
    tasks: Path = typer.Option(DEFAULT_TASKS, "--tasks", help="Steering task set (JSONL)."),
    alpha: Optional[List[float]] = typer.Option(None, "--alpha", help="Alphas to evaluate (repeatable; default 0.01 and 0.1)."),
    mode: Optional[List[str]] = typer.Option(None, "--mode", help="Modes to evaluate (repeatable; default bias and reprefill)."),
    heads: str = typer.Option("auto", "--heads", help="auto | FILE | L:H,..."),
    source: str = typer.Option("full", "--from", help="Version each task is answered from (must exist unless 'full')."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N tasks."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens"),
    work_store: Optional[Path] = typer.Option(None, "--store", help="Store to ingest the task documents into (default: a temporary one)."),
    model: Optional[str] = ModelOpt,
    as_json: bool = JsonOpt,
) -> None:
    """Accuracy on the steering task set: no edit vs `edit --steer` (bias / reprefill modes)."""
    from ..evaluation.steering import evaluate_steering, format_table, load_tasks
    from ..steer.base import EDITS, validate_alpha
    from ..steer.heads import resolve_heads

    alphas = tuple(validate_alpha(a) for a in (alpha or [0.01, 0.1]))
    modes = tuple(mode or ["bias", "reprefill"])
    for m in modes:
        if m not in EDITS:
            raise UsageError(f"unknown steering mode {m!r}", hint=f"choose one of: {', '.join(EDITS)}")
    task_list = load_tasks(tasks)[: limit if limit else None]
    lm = load_lm(model)
    head_map, heads_desc = resolve_heads(heads, lm)
    with tempfile.TemporaryDirectory(prefix="kdn-eval-steer-") as tmp:
        st = open_store(work_store or Path(tmp), create=True)
        try:
            with progress_bar(len(task_list), "eval-steer", unit="task") as bar:
                report = evaluate_steering(lm, st, task_list, heads=head_map, heads_spec=heads_desc, source=source,
                                           alphas=alphas, modes=modes, max_new_tokens=max_new_tokens,
                                           on_progress=lambda _id: bar.update(1))
        finally:
            st.close()
    if as_json:
        emit_json(report)
        return
    print(format_table(report))
    message(f"{report['n_tasks']} tasks, heads {heads_desc} ({report['n_heads']}), {report['seconds']:.0f}s")


def register(app: typer.Typer) -> None:
    app.command("edit")(edit)
    app.command("eval-steer")(eval_steer)
    app.add_typer(steer_app, name="steer")
