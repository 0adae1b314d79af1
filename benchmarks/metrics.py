"""What the suites measure with, defined once: first reach, falls, smoothing, medians of
alternating rounds, the CPU-bound flag and a staleness histogram's mean.

Example:
>>> from benchmarks import metrics
>>> metrics.first_reaching([(10, 0.5), (20, 0.9)], 0.8, key=0, accuracy=1)
20
>>> [config for _, config in metrics.alternating(["a", "b"], rounds=2)]
['a', 'b', 'b', 'a']
"""

import math
import statistics

import numpy as np

CPU_BOUND = 0.7  # the share of the cores above which a run measures the CPU, not the devices


def first_reaching(points, target, key, accuracy="accuracy"):
    """`point[key]` (a step, a time, a sample count) of the first point whose
    `point[accuracy]` is at least `target`; inf if none. Points are dicts, or tuples
    with `key` and `accuracy` as indexes."""
    return next((p[key] for p in points if p[accuracy] >= target), math.inf)


def worst_drop(points, skip_fraction=0.25):
    """The largest fall of `accuracy` below its running best, over the points after the
    first `skip_fraction` of the run's `samples` (the best counts them all)."""
    total = points[-1]["samples"]
    best, worst = -math.inf, 0.0
    for p in points:
        best = max(best, p["accuracy"])
        if p["samples"] >= skip_fraction * total:
            worst = max(worst, best - p["accuracy"])
    return worst


def cpu_bound(cpu_share):
    """Whether a run that used `cpu_share` of the machine's cores measured the CPU."""
    return cpu_share > CPU_BOUND


def alternating(configs, rounds):
    """`(round, config)` for each config of each round, odd rounds in reverse order, so
    that a drift of the machine's speed hits every config alike."""
    configs = list(configs)
    for k in range(rounds):
        for config in configs if k % 2 == 0 else configs[::-1]:
            yield k, config


def median_of(rows, value, **where):
    """The median of `row[value]` over the rows whose fields equal `where`'s."""
    return statistics.median(r[value] for r in rows if all(r[k] == v for k, v in where.items()))


def mean_staleness(histogram):
    """The mean staleness of a histogram of pushes by staleness (0 if it counts none)."""
    return float((np.arange(len(histogram)) * histogram).sum() / max(1, histogram.sum()))


def sliding_mean(values, window, weights=None):
    """Mean over the last `window` points (fewer at the start), optionally weighted: with
    `weights`, point i stands for `weights[i]` minibatches and the mean covers the last
    `window` minibatches (the A-SGD paper smooths training error over 400 minibatches)."""
    values = np.asarray(values, np.float64)
    weights = np.ones_like(values) if weights is None else np.asarray(weights, np.float64)
    cw = np.concatenate([[0.0], np.cumsum(weights)])
    cv = np.concatenate([[0.0], np.cumsum(values * weights)])
    # Each point's earliest start j with cw[i+1] - cw[j] <= window, at least the point itself.
    j = np.minimum(np.searchsorted(cw, cw[1:] - window, side="left"), np.arange(len(values)))
    return (cv[1:] - cv[j]) / (cw[1:] - cw[j])
