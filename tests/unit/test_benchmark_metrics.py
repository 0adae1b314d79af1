"""benchmarks/metrics.py: what every suite measures with."""

import math

import pytest

from benchmarks import metrics


def test_first_reaching_takes_dicts_and_tuples():
    points = [{"step": 1, "accuracy": 0.2}, {"step": 2, "accuracy": 0.9}]
    assert metrics.first_reaching(points, 0.5, "step") == 2
    assert metrics.first_reaching(points, 0.95, "step") == math.inf
    rows = [{"samples": 64, "val_accuracy": 0.7}]
    assert metrics.first_reaching(rows, 0.7, "samples", "val_accuracy") == 64
    assert metrics.first_reaching([(10, 0.5), (20, 0.8)], 0.8, key=0, accuracy=1) == 20


def test_worst_drop_skips_the_first_quarter_but_remembers_its_best():
    acc = [0.9, 0.5, 0.6, 0.85, 0.8, 0.88, 0.87, 0.86]
    points = [{"samples": 100 * i, "accuracy": a} for i, a in enumerate(acc)]
    # The fall to 0.5 comes before a quarter of the samples; after it, the best is 0.9.
    assert metrics.worst_drop(points) == pytest.approx(0.9 - 0.6)
    assert metrics.worst_drop(points, skip_fraction=0.5) == pytest.approx(0.9 - 0.8)


def test_alternating_reverses_odd_rounds_and_median_of_filters():
    order = list(metrics.alternating(("a", "b", "c"), rounds=3))
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "c"), (1, "b"), (1, "a")] + [
        (2, "a"),
        (2, "b"),
        (2, "c"),
    ]
    rows = [{"config": c, "round": k, "s": 10 * k + len(c)} for k, c in order]
    assert metrics.median_of(rows, "s", config="b") == 11
    assert metrics.median_of(rows, "s", config="b", round=2) == 21


def test_cpu_bound_and_sliding_mean():
    assert metrics.cpu_bound(0.71) and not metrics.cpu_bound(0.7)
    assert metrics.sliding_mean([1, 1, 0, 0], window=2).tolist() == [1.0, 1.0, 0.5, 0.0]
    # Weighted: each point stands for 2 minibatches, so a window of 4 spans two points.
    weighted = metrics.sliding_mean([1, 0, 0], window=4, weights=[2, 2, 2]).tolist()
    assert weighted == [1.0, 0.5, 0.0]
