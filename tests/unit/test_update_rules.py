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


def _plain_moving_average(value, stats, momentum, steps):
    """Keras's update of a moving average, `steps` times toward `stats`."""
    for _ in range(steps):
        value = momentum * value + (1 - momentum) * stats
    return value


@pytest.mark.parametrize("momentum,steps", [(0.99, 10), (0.9, 10), (0.5, 3)])
def test_a_moving_average_push_takes_the_windows_steps_from_where_it_stands(momentum, steps):
    """A window pulled 1.0 and took `k` steps toward 0.01; by its push, other pushes had
    moved the variance to 0.02. Applied where it stands, the push equals plain Keras's `k`
    steps from 0.02 and stays above 0; added as it was (`end - pulled`) it went below 0
    at low momentum. N such pushes in turn equal plain Keras's N k steps."""
    pulled, stats, now = 1.0, 0.01, 0.02
    end = _plain_moving_average(pulled, stats, momentum, steps)
    sent = update_rules.moving_average_sent(end, pulled, momentum, steps)
    pushed = update_rules.moving_average_push(now, sent, momentum, steps)
    np.testing.assert_allclose(pushed, _plain_moving_average(now, stats, momentum, steps))
    assert pushed > 0
    if momentum <= 0.9:
        assert now + (end - pulled) < 0  # the delta added as it was
    value = 1.0
    for _ in range(4):
        value = update_rules.moving_average_push(value, sent, momentum, steps)
    np.testing.assert_allclose(value, _plain_moving_average(1.0, stats, momentum, 4 * steps))
    # A push not made (scale 0) leaves it.
    assert update_rules.moving_average_push(now, sent, momentum, steps, scale=0.0) == now
