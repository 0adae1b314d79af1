"""Outer optimizers: the PS's TF ops against the pure NumPy rule, push by push."""

import numpy as np
import pytest
import tensorflow as tf

from tf_asgd import outer, update_rules

OPTIMIZERS = [
    update_rules.OuterSGD(),
    update_rules.OuterSGD(0.5),
    update_rules.OuterSGD(0.7, momentum=0.9),
    update_rules.OuterSGD(0.7, momentum=0.9, nesterov=True),
    update_rules.DelayedNesterov(0.7, 0.9),
    update_rules.DelayedNesterov(1.0, 0.5, delay=3),
]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=repr)
def test_tf_ops_match_the_numpy_rule(opt):
    rng = np.random.default_rng(0)
    workers, rule = 4, "dynsgd"
    start = rng.normal(size=(5, 3)).astype(np.float32)
    var = tf.Variable(start)
    slots = outer.create_slots(opt, var)

    @tf.function
    def push(piece, scale, ticket):
        outer.apply(opt, var, piece, slots, scale, ticket, workers)

    central, state = start.copy(), {}
    for ticket in range(11):
        update = rng.normal(size=start.shape).astype(np.float32)
        tau = int(rng.integers(0, 4))
        scale = update_rules.staleness_scale(tau, rule)
        push(tf.constant(update), tf.constant(scale), tf.constant(ticket, tf.int64))
        central, state = update_rules.ps_push(central, update, tau, ticket, state, rule,
                                              outer=opt, num_workers=workers)
        np.testing.assert_allclose(var.numpy(), central, rtol=1e-5, atol=1e-6)
        for name, slot in slots.items():
            np.testing.assert_allclose(slot.numpy(), state[name], rtol=1e-5, atol=1e-6)


def test_defaults_are_the_classic_parameter_server():
    central, update = np.array([1.0, 2.0]), np.array([4.0, -4.0])
    out, state = update_rules.ps_push(central, update, 3, 7, {}, "dynsgd")
    np.testing.assert_allclose(out, [2.0, 1.0])
    assert state == {} and update_rules.OuterSGD().slots == ()


def test_delayed_nesterov_is_diloco_over_each_group():
    # Over `delay` pushes: theta -= lr * (mean(g) + mu * v), v = mu * v + mean(g) (Nesterov).
    opt = update_rules.DelayedNesterov(0.7, 0.9, delay=2)
    theta, state = np.zeros(1), {}
    gs = [1.0, 3.0, -1.0, 5.0]
    m, ref = 0.0, 0.0
    for ticket, g in enumerate(gs):
        theta, state = update_rules.outer_step(opt, theta, np.array([g]), state, ticket, 2)
        if ticket % 2:
            mean = (gs[ticket - 1] + g) / 2
            m = 0.9 * m + mean
            ref -= 0.7 * (mean + 0.9 * m)
            np.testing.assert_allclose(theta, [ref])


@pytest.mark.parametrize("make,error,match", [
    (lambda: update_rules.OuterSGD(0.0), ValueError, "learning_rate must be a number > 0"),
    (lambda: update_rules.OuterSGD(1.0, momentum=1.0), ValueError, r"momentum must be in \[0, 1\)"),
    (lambda: update_rules.OuterSGD(1.0, nesterov=True), ValueError, "needs momentum > 0"),
    (lambda: update_rules.DelayedNesterov(delay=0), ValueError, "delay must be a positive integer"),
    (lambda: update_rules.validate_outer_optimizer("adam"), TypeError, "outer_optimizer must be"),
    (lambda: update_rules.validate_worker_state("zero"), ValueError, "Unknown worker_state 'zero'"),
])
def test_bad_outer_configuration(make, error, match):
    with pytest.raises(error, match=match):
        make()
