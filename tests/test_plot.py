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


def _kinds_run(label_fracs, kinds):
    """A bench/quality.py result: a full cache and versions ``(label, fp16 fraction, {kind: (acc, nll)})``."""
    versions = [{"label": "full", "fp16_fraction": 2.0, "by_answer_kind": {}}]
    for label, frac, by in label_fracs:
        bk = {k: {"n": kinds[k], "median_nll_ratio": nll, **({} if acc is None else {"accuracy_vs_full": acc})}
              for k, (acc, nll) in by.items()}
        versions.append({"label": label, "fp16_fraction": frac, "by_answer_kind": bk})
    return {"versions": versions}


def test_answer_kind_points_pair_each_kind_with_its_run(tmp_path):
    from kdnctl.evaluation.plot import answer_kind_points, plot_answer_kinds

    digits = _kinds_run([("b0.25", 0.22, {"digits": (0.975, 1.003), "continuation": (None, 1.0)}),
                         ("b0.083", 0.081, {"digits": (0.926, 0.985), "continuation": (None, 1.033)})],
                        {"digits": 100, "continuation": 30})
    words = _kinds_run([("b0.25", 0.221, {"words": (0.979, 1.001)}), ("b0.083", 0.082, {"words": (0.854, 1.59)})],
                       {"words": 60})
    pts = answer_kind_points([digits, words])
    assert pts["accuracy_vs_full", "words"] == [("b0.25", 0.221, 0.979, 60), ("b0.083", 0.082, 0.854, 60)]
    assert pts["accuracy_vs_full", "digits"][1] == ("b0.083", 0.081, 0.926, 100)
    assert ("accuracy_vs_full", "continuation") not in pts  # continuations have no answer to count
    assert [p[2] for p in pts["median_nll_ratio", "continuation"]] == [1.0, 1.033]
    assert all(label != "full" for v in pts.values() for label, *_ in v)
    out = plot_answer_kinds([digits, words], tmp_path / "kinds.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    only = answer_kind_points([digits, words], labels={"b0.083"})
    assert {label for v in only.values() for label, *_ in v} == {"b0.083"}
    # a dict picks and renames: a variant drawn under the name it has as the default now
    renamed = answer_kind_points([digits, words], labels={"b0.083": "b0.083-old", "b0.25": "b0.25"})
    assert renamed["accuracy_vs_full", "words"] == [("b0.25", 0.221, 0.979, 60), ("b0.083-old", 0.082, 0.854, 60)]
