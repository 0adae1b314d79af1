"""benchmarks/ceiling_share.py on the committed ceiling and runs of MNIST-1D 64k."""

import os

import numpy as np
import pytest

from benchmarks import ceiling_share

from helpers import ROOT

CEILING = os.path.join(ROOT, "results", "synchronous_rounds", "ceiling", "ceiling.csv")
RUNS = os.path.join(
    ROOT, "results", "workers_rate", "anneal_to_one", "mnist1d64k_2_4", "curves.csv"
)


def test_both_shares_follow_their_definitions_on_saved_runs():
    ceiling = ceiling_share.ceilings(ceiling_share.read([CEILING]))
    # Seed 0's batch of 64 reached 0.9575 at 1,150 steps (rate 1.6e-2); batch 32 at 2,550.
    assert ceiling[(0, 2)] == (1150.0, pytest.approx(2550 / 1150, abs=1e-5), 0.9575)
    rules = ceiling_share.runs(ceiling_share.read([RUNS]), "async_outer", "")
    cells = {(r["workers"], r["seed"]): r for r in ceiling_share.shares(ceiling, rules)}
    assert set(cells) == {(2, 0), (2, 1), (4, 0), (4, 1)}  # seed 2 has no ceiling there
    cell = cells[(2, 0)]
    # Against the recipe: plain took 3,050 steps to 0.9525 and the rule 1,750.
    assert cell["recipe"] == pytest.approx((3050 / 1750) / (2550 / 1150), abs=1e-4)
    # Strict: the rule's first held-out point at 0.9575 or above.
    first = min(s for s, a in rules[(0, 2)]["points"] if a >= 0.9575)
    assert cell["strict"] == pytest.approx(1150 / first)
    # Finals against plain's: 0.970 against 0.9625 at the last point.
    assert cell["final"] == pytest.approx(0.0075)
    # Smoothed over 400 minibatches: the last 200 steps of 2 workers (to step 4,000) and
    # the last 400 of plain's (to 8,000).
    rule = [a for s, a in rules[(0, 2)]["points"] if s > 3800]
    plain = [a for s, a in rules[(0, 1)]["points"] if s > 7600]
    assert (len(rule), len(plain)) == (4, 8)
    assert cell["smoothed"] == pytest.approx(np.mean(rule) - np.mean(plain))
    lines = ceiling_share.summary(list(cells.values()))
    assert any(line.startswith("| 2 | 2 seeds |") for line in lines)


def test_runs_without_a_ceiling_are_refused(tmp_path):
    empty = tmp_path / "ceiling.csv"
    empty.write_text("setup,seed,workers,rate,final_accuracy,target,steps_to_target,speedup\n")
    with pytest.raises(SystemExit, match="has a ceiling"):
        ceiling_share.main(["--ceiling", str(empty), "--curves", RUNS])
    with pytest.raises(SystemExit, match="has a ceiling"):  # no run of another setup
        ceiling_share.main(["--ceiling", CEILING, "--curves", RUNS, "--setup", "digits_adam"])
