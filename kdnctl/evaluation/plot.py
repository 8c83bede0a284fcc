"""Quality-vs-budget plot for ``kdnctl eval --plot``: one line per method (and quantizer, and
scorer when not the default) over the budgets evaluated, accuracy and KL vs the full cache side
by side (accuracy counts are small; KL is the steadier signal)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from ..scorers import DEFAULT_SCORER

METRICS = ("accuracy", "kl")


def _step(recipe: dict) -> dict:
    steps = recipe.get("steps", [recipe])
    return next((s for s in reversed(steps) if s.get("step") == "compress"), {})


def _series(versions: list[dict], full: dict, metric: str) -> dict[str, list[tuple[float, float]]]:
    series: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for v in versions:
        step = _step(v.get("recipe") or {})
        if not step or v.get(metric) is None or step["budget"] >= 1:
            continue
        name = step["method"] if "allocator" not in step else f"{step['allocator']}:{step['method']}"
        if step.get("scorer", DEFAULT_SCORER) != DEFAULT_SCORER and step["method"] in ("kvcrush", "spans"):
            name += f" ({step['scorer']})"
        if step.get("quant", "none") != "none":
            name += f"+{step['quant']}"
        series[name].append((step["budget"], v[metric]))
    # a line needs a sweep: single-budget variants are in the tables, not the plot
    return {n: sorted(p) + [(1.0, full[metric])] for n, p in series.items() if len(p) > 1}


def _save(fig, out: str | Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_quality(result: dict, out: str | Path, metrics: tuple[str, ...] = METRICS) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    versions = result["versions"]
    full = next(v for v in versions if v["label"] == "full")
    fig, axes = plt.subplots(1, len(metrics), figsize=(5.5 * len(metrics), 4.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for i, (name, pts) in enumerate(sorted(_series(versions, full, metric).items())):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="osD^v<>"[i % 7], label=name)
        ax.axhline(full[metric], color="grey", linestyle="--", linewidth=1, label="full cache")
        ax.set_xlabel("budget (fraction of tokens kept)")
        ax.set_ylabel(metric if metric != "kl" else "KL(full || version)")
        ax.set_title(f"{metric} vs budget")
        ax.legend(fontsize=8)
    return _save(fig, out)


TASK_METRICS = (("needle", "accuracy", "needle accuracy"), ("multifact", "accuracy", "multi-fact accuracy"),
                ("continuation", "nll", "continuation NLL"))


def plot_quality_vs_bytes(result: dict, out: str | Path) -> Path:
    """``kdnctl eval --tasks --plot``: one panel per task kind, one labelled point per version,
    x = stored K/V bytes as a fraction of fp16, the full cache as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    versions = result["versions"]
    full = next(v for v in versions if v["label"] == "full")
    fig, axes = plt.subplots(1, len(TASK_METRICS), figsize=(5.5 * len(TASK_METRICS), 4.4), squeeze=False)
    for ax, (kind, key, title) in zip(axes[0], TASK_METRICS):
        for i, v in enumerate(versions):
            y, x = v[kind].get(key), v.get("fp16_fraction")
            if y is None or x is None or v["label"] == "full":
                continue
            ax.scatter([x], [y], marker="osD^v<>"[i % 7], label=v["label"])
            ax.annotate(v["label"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
        if full[kind].get(key) is not None:
            ax.axhline(full[kind][key], color="grey", linestyle="--", linewidth=1, label="full cache")
        ax.set_xscale("log")
        ax.set_xlabel("stored K/V bytes / fp16 K/V bytes")
        ax.set_ylabel(title + (f" (n={full[kind]['n']})" if full[kind].get("n") else ""))
        ax.set_title(f"{title} vs bytes")
    axes[0][0].legend(fontsize=6)
    return _save(fig, out)


ANSWER_KIND_PANELS = (("accuracy_vs_full", "accuracy / full cache's", ("digits", "words")),
                      ("median_nll_ratio", "median NLL / full cache's", ("digits", "words", "continuation")))


def answer_kind_points(results: list[dict], labels: set[str] | dict[str, str] | None = None
                       ) -> dict[tuple[str, str], list[tuple[str, float, float, int]]]:
    """``(metric, answer kind) -> [(version label, stored fp16 fraction, value, tasks)]`` of every
    version but the full cache in ``results`` (runs of ``bench/quality.py``, each paired against
    its own full cache: ``by_answer_kind``), only those named in ``labels`` where given (a dict
    also renames: label -> the name drawn). A kind two runs both measured for one label is drawn
    once per run."""
    shown = dict(zip(labels, labels)) if isinstance(labels, (set, frozenset, list, tuple)) else labels
    points: dict[tuple[str, str], list] = defaultdict(list)
    for result in results:
        for v in result["versions"]:
            x = v.get("fp16_fraction")
            if v["label"] == "full" or x is None or (shown is not None and v["label"] not in shown):
                continue
            name = v["label"] if shown is None else shown[v["label"]]
            for metric, _, kinds in ANSWER_KIND_PANELS:
                for kind in kinds:
                    k = (v.get("by_answer_kind") or {}).get(kind) or {}
                    if k.get(metric) is not None:
                        points[metric, kind].append((name, x, k[metric], k["n"]))
    return points


def plot_answer_kinds(results: list[dict], out: str | Path, labels: set[str] | dict[str, str] | None = None) -> Path:
    """The equal-bytes plot per answer kind: x = stored K/V bytes as a fraction of fp16, one
    panel for accuracy and one for the median answer NLL, each as a ratio to the full cache of
    the same run (1 = no loss, the dashed line), a marker per kind, each point labelled with its
    version and task count; the versions named in ``labels``, else all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = answer_kind_points(results, labels)
    markers = {"digits": "o", "words": "s", "continuation": "^"}
    lift = {"digits": 4, "words": -6, "continuation": -16}  # labels of points at one spot stay apart
    fig, axes = plt.subplots(1, len(ANSWER_KIND_PANELS), figsize=(6.5 * len(ANSWER_KIND_PANELS), 4.4), squeeze=False)
    for ax, (metric, title, kinds) in zip(axes[0], ANSWER_KIND_PANELS):
        for kind in kinds:
            pts = points.get((metric, kind), [])
            if not pts:
                continue
            ax.scatter([p[1] for p in pts], [p[2] for p in pts], marker=markers[kind], label=kind)
            for label, x, y, n in pts:
                ax.annotate(f"{label} ({kind}, n={n})", (x, y), fontsize=6, xytext=(4, lift[kind]),
                            textcoords="offset points")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="full cache")
        ax.set_xscale("log")
        ax.set_xlabel("stored K/V bytes / fp16 K/V bytes")
        ax.set_ylabel(title)
        ax.set_title(f"{title}, by answer kind")
        ax.legend(fontsize=7)
    return _save(fig, out)
