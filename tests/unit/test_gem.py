"""GEM: exactness against a NumPy reference written from the paper's formulas,
serialization, observability and bad input."""

import keras
import numpy as np
import pytest

import tf_asgd
from tf_asgd.rules import gem_rule

from gem_reference import KAPPA, LR, MU, _mse_grads, _tiny_model, _tiny_problem


def test_single_process_gem_is_the_paper_rule():
    """Outside a cluster GEM is an ordinary optimizer: one worker, n_sync = 1."""
    x, t = _tiny_problem()
    model = _tiny_model()
    model.compile(tf_asgd.optimizers.GEM(keras.optimizers.SGD(LR, momentum=MU), kappa=KAPPA), "mse")
    w, b = (v.numpy().astype("float64") for v in model.trainable_variables)
    m, prev = [np.zeros_like(w), np.zeros_like(b)], None
    model.fit(x, t, batch_size=8, epochs=10, shuffle=False, verbose=0)
    for _ in range(10):
        gw, gb = _mse_grads(w, b, x, t)
        out = []
        for i, (c, g) in enumerate([(w, -LR * gw), (b, -LR * gb)]):
            dc = c - prev[i] if prev is not None else np.zeros_like(c)
            pushed, m[i], _ = gem_rule.gem_step(g, m[i], dc, MU, KAPPA)
            out.append(c + pushed)
        prev = [w, b]
        w, b = out
    np.testing.assert_allclose(model.trainable_variables[0].numpy(), w, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(model.trainable_variables[1].numpy(), b, rtol=2e-5, atol=2e-6)


def test_gem_config_round_trip_with_schedule():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=100, decay_rate=0.5)
    opt = tf_asgd.optimizers.GEM(
        keras.optimizers.SGD(schedule, momentum=0.8), kappa=1.5, pi_max=3.0
    )
    again = tf_asgd.optimizers.GEM.from_config(opt.get_config())
    assert (again.kappa, again.pi_max, again.momentum) == (1.5, 3.0, 0.8)
    assert isinstance(again.inner._learning_rate, keras.optimizers.schedules.ExponentialDecay)
    restored = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert isinstance(restored, tf_asgd.optimizers.GEM)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.1)), "momentum > 0"),
        (lambda: tf_asgd.optimizers.GEM(keras.optimizers.Adam()), "momentum > 0"),
        (
            lambda: tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True)),
            "nesterov",
        ),
        (
            lambda: tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.1, momentum=0.9), kappa=0),
            "kappa must be a finite number > 0",
        ),
        (
            lambda: tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.1, momentum=0.9), kappa=-1),
            "kappa",
        ),
        (
            lambda: tf_asgd.optimizers.GEM(
                keras.optimizers.SGD(0.1, momentum=0.9), pi_max=float("inf")
            ),
            "pi_max",
        ),
        (
            lambda: tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.1, momentum=0.9), pi_max=0),
            "pi_max",
        ),
        (lambda: tf_asgd.optimizers.GEM("sgd"), "wraps a Keras optimizer"),
    ],
)
def test_gem_bad_input(make, match):
    with pytest.raises(ValueError, match=match):
        make()
