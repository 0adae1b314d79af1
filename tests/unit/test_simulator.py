"""The many-worker simulator: exact on one worker, the staleness it is asked
for, the cluster's update rules (not a copy), and GEM's stability claim as
measured on digits."""

import numpy as np
import pytest

from tf_asgd.rules import gem_rule, staleness
from tf_asgd.sim import simulator


@pytest.fixture(scope="module")
def digits():
    return simulator.digits_features()


def test_one_worker_is_sequential_sgd(digits):
    (x, y), _ = digits
    run = simulator.simulate(
        x,
        y,
        method="downpour",
        workers=1,
        pushes=30,
        n_sync=2,
        batch_size=16,
        eta=0.1,
        timing="constant",
        eval_every=30,
        seed=3,
    )
    # The same random stream, trained by hand.
    rng = np.random.default_rng(3)
    model = simulator.NumpyModel(64, 10, hidden=32)
    params = model.init(rng)
    for _ in range(30 * 2):
        idx = rng.integers(0, len(x), 16)
        for p, g in zip(params, model.gradients(params, x[idx], y[idx])):
            p -= 0.1 * g
    loss, acc = model.loss_and_accuracy(params, x, y)
    assert run.records[-1]["loss"] == pytest.approx(loss, rel=1e-5)
    assert run.records[-1]["accuracy"] == acc
    assert run.staleness_histogram.tolist() == [30]


def test_round_robin_staleness_is_workers_minus_one(digits):
    (x, y), _ = digits
    run = simulator.simulate(
        x, y, method="dynsgd", workers=8, pushes=100, timing="constant", eval_every=100
    )
    h = run.staleness_histogram
    assert h.sum() == 100
    assert h[7] == 100 - 7 and h[:7].tolist() == [1] * 7


@pytest.mark.parametrize(
    "delay,check",
    [
        ("fixed", lambda taus, w: set(taus[5 * w :]) == {w - 1}),
        ("geometric", lambda taus, w: abs(np.mean(taus) - (w - 1)) < 0.25 * (w - 1)),
        (
            "uniform",
            lambda taus, w: (
                max(taus) <= 2 * (w - 1) and abs(np.mean(taus) - (w - 1)) < 0.2 * (w - 1)
            ),
        ),
    ],
)
def test_explicit_delay_distributions(digits, delay, check):
    (x, y), _ = digits
    run = simulator.simulate(
        x, y, method="downpour", workers=16, pushes=1500, delay=delay, eta=0.01, eval_every=10**6
    )
    taus = np.repeat(np.arange(len(run.staleness_histogram)), run.staleness_histogram)
    assert len(taus) == 1500
    assert check(taus, 16)


def test_uses_the_cluster_update_rules(digits, monkeypatch):
    (x, y), _ = digits
    calls = {"gem_step": 0, "ps_push": 0}
    modules = {"gem_step": gem_rule, "ps_push": staleness}

    def spy(name):
        real = getattr(modules[name], name)

        def wrapped(*a, **k):
            calls[name] += 1
            return real(*a, **k)

        return wrapped

    for name in calls:
        monkeypatch.setattr(modules[name], name, spy(name))
    run = simulator.simulate(x, y, method="gem", workers=4, pushes=10, hidden=0, eval_every=5)
    assert calls == {"gem_step": 20, "ps_push": 20}  # 10 pushes x 2 tensors
    assert [sorted(k for k in r if k != "push") for r in run.pi][0] == sorted(
        f"{n}:{s}" for n in ("dense/kernel", "dense/bias") for s in ("mean", "median")
    )


def test_gem_stays_stable_at_100_workers_where_downpour_does_not(digits):
    (x, y), (xt, yt) = digits
    final = {}
    for method in ("downpour", "gem"):
        run = simulator.simulate(
            x,
            y,
            method=method,
            workers=100,
            pushes=3000,
            eta=0.3,
            eval_every=500,
            eval_data=(xt, yt),
            seed=0,
        )
        final[method] = run.records[-1]
    assert final["gem"]["loss"] < 0.3 and final["gem"]["accuracy"] > 0.9
    assert final["downpour"]["loss"] > 1.0


def test_bad_arguments(digits):
    (x, y), _ = digits
    with pytest.raises(ValueError, match="method"):
        simulator.simulate(x, y, method="adam")
    with pytest.raises(ValueError, match="delay"):
        simulator.simulate(x, y, delay="poisson")
    with pytest.raises(ValueError, match="timing"):
        simulator.simulate(x, y, timing="bursty")
