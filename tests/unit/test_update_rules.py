"""The pure rules, against values worked out by hand."""

import numpy as np
import pytest
import tensorflow.experimental.numpy as tnp

from tf_asgd.rules import update_rules


def test_staleness_scales():
    taus = np.array([0, 1, 3, 9])
    np.testing.assert_allclose(update_rules.staleness_scale(taus, "none"), [1, 1, 1, 1])
    np.testing.assert_allclose(update_rules.staleness_scale(taus, "dynsgd"), [1, 0.5, 0.25, 0.1])
    np.testing.assert_allclose(
        update_rules.staleness_scale(taus, "dynsgd", max_staleness=2), [1, 0.5, 0, 0]
    )


def test_numpy_and_tf_agree():
    taus = np.arange(6)
    np.testing.assert_allclose(
        update_rules.staleness_scale(taus, "dynsgd", 3),
        np.asarray(update_rules.staleness_scale(taus, "dynsgd", 3, xp=tnp)),
    )
    rng = np.random.default_rng(0)
    g, m, dc = (rng.normal(size=20).astype("float32") for _ in range(3))
    ref = update_rules.gem_step(g, m, dc, 0.9, 2.0)
    got = update_rules.gem_step(tnp.asarray(g), tnp.asarray(m), tnp.asarray(dc), 0.9, 2.0, xp=tnp)
    for a, b in zip(ref, got):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6)


def test_apply_push():
    out = update_rules.apply_push(np.array([1.0, 2.0]), np.array([4.0, -4.0]), tau=3, rule="dynsgd")
    np.testing.assert_allclose(out, [2.0, 1.0])


def test_gem_pi_by_hand():
    # kappa|m| - |dc| over |g|: (2*0.5 - 0.1)/0.3 = 3; clipped at 5 and at 0.
    g, m, dc = np.array([0.3, 0.1, 0.3]), np.array([0.5, 1.0, 0.01]), np.array([0.1, 0.0, 0.5])
    np.testing.assert_allclose(update_rules.gem_pi(g, m, dc, kappa=2.0), [3.0, 5.0, 0.0], rtol=1e-9)
    pushed, new_m, pi = update_rules.gem_step(g, m, dc, mu=0.5, kappa=1.0)
    np.testing.assert_allclose(new_m, 0.5 * m + g)
    np.testing.assert_allclose(pushed, pi * g)


@pytest.mark.parametrize(
    "rule,max_staleness,match",
    [
        ("adagrad", None, "Unknown staleness rule 'adagrad'"),
        ("dynsgd", -1, "max_staleness must be >= 0"),
        ("none", 1.5, "max_staleness must be a non-negative integer"),
    ],
)
def test_bad_staleness_config(rule, max_staleness, match):
    with pytest.raises(ValueError, match=match):
        update_rules.validate_staleness(rule, max_staleness)


@pytest.mark.parametrize("momentum,steps,workers", [(0.99, 10, 2), (0.99, 10, 8), (0.9, 100, 4)])
def test_a_round_of_moving_average_pushes_moves_as_far_as_plain_keras(momentum, steps, workers):
    """N pushes from one pulled value, each `1 - m^k` of the way times the gain, move a
    moving average `1 - m^(N k)` of the way, as N windows' steps do in plain Keras; the
    per-push gain stays within [1/N, 1]."""
    gain = update_rules.moving_average_gain(momentum, steps, workers)
    moved = workers * gain * (1 - momentum**steps)
    np.testing.assert_allclose(moved, 1 - momentum ** (workers * steps), rtol=1e-12)
    assert 1 / workers - 1e-12 <= gain <= 1.0
    assert gain * (1 - momentum**steps) < update_rules.stability_limit(workers)
