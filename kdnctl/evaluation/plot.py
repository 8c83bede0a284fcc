"""Quality-vs-budget plot for ``kdnctl eval --plot``."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path


def _step(recipe: dict) -> dict:
    steps = recipe.get("steps", [recipe])
    return next((s for s in reversed(steps) if s.get("step") == "compress"), {})


def plot_quality(result: dict, out: str | Path, metric: str = "accuracy") -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    versions = result["versions"]
    full = next(v for v in versions if v["label"] == "full")
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for v in versions:
        step = _step(v.get("recipe") or {})
        if not step or v.get(metric) is None:
            continue
        name = step["method"] + ("" if step.get("quant", "none") == "none" else f"+{step['quant']}")
        series[name].append((step["budget"], v[metric]))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in sorted(series.items()):
        pts = sorted(pts) + ([(1.0, full[metric])] if "+" not in name else [])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.axhline(full[metric], color="grey", linestyle="--", linewidth=1, label="full cache")
    ax.set_xlabel("budget (fraction of tokens kept)")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} vs budget")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
