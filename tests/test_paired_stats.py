"""Paired statistics of a version against the full cache (kdnctl/evaluation/paired.py): each
statistic against its naive reference, and the properties the tables rely on."""

from __future__ import annotations

import random

import pytest

from kdnctl.evaluation.paired import (
    bootstrap_ratio_ci,
    mcnemar_p,
    naive_bootstrap_ratio_ci,
    naive_mcnemar_p,
    paired_markdown,
    paired_vs_full,
)


@pytest.mark.parametrize("lost,gained", [(0, 0), (1, 0), (0, 1), (4, 2), (2, 4), (3, 3), (12, 2), (9, 1), (7, 0), (6, 5)])
def test_mcnemar_matches_enumeration(lost, gained):
    assert mcnemar_p(lost, gained) == pytest.approx(naive_mcnemar_p(lost, gained), abs=1e-12)


def test_mcnemar_known_values():
    assert mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(4, 2) == pytest.approx(44 / 64)  # 2 * (1 + 6 + 15) / 2**6
    assert mcnemar_p(7, 0) == pytest.approx(2 / 128)
    assert mcnemar_p(20, 0) < 1e-5 and mcnemar_p(20, 0) == mcnemar_p(0, 20)


@pytest.mark.parametrize("n,seed", [(1, 0), (7, 1), (40, 2), (61, 3)])
def test_bootstrap_matches_plain_loop(n, seed):
    rng = random.Random(seed)
    ref = [float(rng.random() < 0.5) for _ in range(n)]
    mine = [float(r and rng.random() < 0.8) for r in ref]
    nll = [rng.uniform(1, 3) for _ in range(n)]
    for a, b in ((mine, ref), ([x * 1.1 for x in nll], nll)):
        fast, slow = bootstrap_ratio_ci(a, b, resamples=300), naive_bootstrap_ratio_ci(a, b, resamples=300)
        if fast is None:
            assert slow is None
        else:
            assert fast == pytest.approx(slow, abs=1e-9)


def test_bootstrap_interval_brackets_the_ratio_and_narrows_with_more_tasks():
    rng = random.Random(5)
    ref = [rng.uniform(1, 3) for _ in range(400)]
    mine = [r * rng.uniform(1.0, 1.2) for r in ref]
    lo40, hi40 = bootstrap_ratio_ci(mine[:40], ref[:40])
    lo400, hi400 = bootstrap_ratio_ci(mine, ref)
    point = sum(mine) / sum(ref)
    assert lo400 < point < hi400 and 1.0 < lo400
    assert hi400 - lo400 < (hi40 - lo40) / 2
    assert bootstrap_ratio_ci(ref, ref) == pytest.approx((1.0, 1.0))
    assert bootstrap_ratio_ci([1.0], [0.0]) is None  # no full-cache answer: no ratio
    with pytest.raises(ValueError):
        bootstrap_ratio_ci([1.0], [1.0, 2.0])


def test_paired_vs_full_counts_lost_and_gained_on_shared_tasks():
    full = {f"t{i}": {"correct": i < 6, "nll": 1.0} for i in range(10)}
    mine = {f"t{i}": {"correct": i in (0, 1, 2, 7), "nll": 1.5} for i in range(9)}  # t9 not answered
    s = paired_vs_full(mine, full, [f"t{i}" for i in range(10)], "multifact")
    assert (s["n"], s["lost"], s["gained"]) == (9, 3, 1)
    assert s["p"] == pytest.approx(mcnemar_p(3, 1), abs=1e-4)
    assert s["answer_nll_ratio_ci"] == pytest.approx([1.5, 1.5])
    lo, hi = s["accuracy_ratio_ci"]
    assert lo <= 4 / 6 <= hi
    cont = paired_vs_full({"c": {"nll": 2.2}}, {"c": {"nll": 2.0}}, ["c"], "continuation")
    assert cont == {"n": 1, "nll_ratio_ci": pytest.approx([1.1, 1.1])}


def test_paired_table_has_a_row_per_compressed_version():
    result = {"versions": [
        {"label": "full"},
        {"label": "x", "paired_vs_full": {
            "needle": {"n": 3, "lost": 1, "gained": 0, "p": 1.0, "accuracy_ratio_ci": [0.5, 1.0]},
            "multifact": {"n": 2, "lost": 0, "gained": 0, "p": 1.0, "accuracy_ratio_ci": None,
                          "answer_nll_ratio_ci": [1.0, 1.25]},
            "continuation": {"n": 1, "nll_ratio_ci": [1.02, 1.02]}}}]}
    lines = paired_markdown(result).splitlines()
    assert len(lines) == 3
    assert lines[2] == "| x | 1/0 (1.00) | 50.0%-100.0% | 0/0 (1.00) | - | 100.0%-125.0% | 102.0%-102.0% |"
