"""The quality-vs-budget plot draws one line per swept method from eval results."""

from __future__ import annotations

from kdnctl.evaluation.plot import _series, plot_quality


def _v(label, method, budget, acc, kl, scorer="hybrid", quant="none"):
    step = {"step": "compress", "method": method, "budget": budget, "scorer": scorer, "quant": quant}
    return {"label": label, "accuracy": acc, "kl": kl, "recipe": {"steps": [{"step": "ingest"}, step]}}


def test_plot_lines_and_file(tmp_path):
    result = {"versions": [
        {"label": "full", "accuracy": 0.5, "kl": 0.0, "recipe": {"step": "ingest"}},
        _v("a", "kvcrush", 0.25, 0.2, 0.6), _v("b", "kvcrush", 0.5, 0.3, 0.2),
        _v("c", "snapkv", 0.25, 0.1, 1.5), _v("d", "snapkv", 0.5, 0.2, 0.7),
        _v("e", "kvcrush", 0.25, 0.1, 1.4, scorer="window"),  # single budget: not a line
        _v("f", "kvcrush", 1.0, 0.5, 0.0, quant="int8"),      # quantization only: not a line
    ]}
    full = result["versions"][0]
    lines = _series(result["versions"], full, "kl")
    assert lines == {"kvcrush": [(0.25, 0.6), (0.5, 0.2), (1.0, 0.0)], "snapkv": [(0.25, 1.5), (0.5, 0.7), (1.0, 0.0)]}
    out = plot_quality(result, tmp_path / "q.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
