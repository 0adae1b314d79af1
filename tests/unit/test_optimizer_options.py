"""Keras optimizer options without a cluster: the stateless step a window runs leaves every
variable as Keras's own `apply` does, and the parameter servers' EMA rule in NumPy
(tests/ema_reference.py) is Keras's own EMA when each push is one step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_asgd import internals

from ema_reference import LOSS, _assert_close, _ema_reference, _flat, _mlp, _Record

# ---- the stateless step a window runs, against Keras's own apply (no cluster) --

GRADS = [
    [1.0, 2.0, 3.0],
    [0.5, -1.0, 2.0],
    [np.inf, 1.0, 1.0],
    [3.0, 3.0, 3.0],
    [1.0, 0.0, -1.0],
    [2.0, 2.0, 2.0],
    [1.0, 1.0, 1.0],
]


@pytest.mark.parametrize(
    "make",
    [
        lambda: keras.optimizers.SGD(
            0.1, momentum=0.9, gradient_accumulation_steps=2, clipnorm=1.0
        ),
        lambda: keras.optimizers.Adam(0.1, gradient_accumulation_steps=3, weight_decay=0.1),
        lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.5), initial_scale=4.0, dynamic_growth_steps=2
        ),
    ],
    ids=["sgd-accumulation-clipnorm", "adam-accumulation-weight-decay", "loss-scale"],
)
def test_window_step_equals_keras_apply(make):
    """`internals.stateless_apply` (what each local step runs) leaves the
    variable and every optimizer variable (accumulators, loss scale, step
    counters) exactly as Keras's `apply` does, step by step; the non-finite
    gradient is skipped by the loss-scale optimizer (and only fed to it)."""
    loss_scale = isinstance(make(), keras.optimizers.LossScaleOptimizer)
    grads = [np.asarray(g, np.float32) for g in GRADS if loss_scale or np.isfinite(g).all()]
    keras.utils.set_random_seed(0)
    v1, o1 = keras.Variable(np.ones([3], np.float32)), make()
    o1.build([v1])
    v2, o2 = keras.Variable(np.ones([3], np.float32)), make()
    o2.build([v2])

    @tf.function
    def step(values, weights, grad):
        return internals.stateless_apply(o2, values, [grad], weights)

    values, weights = [v.value for v in o2.variables], [v2.value]
    for g in grads:
        o1.apply([tf.constant(g)], [v1])
        weights, values = step(values, weights, tf.constant(g))
        np.testing.assert_array_equal(np.asarray(weights[0]), v1.numpy())
        for want, got in zip(o1.variables, values):
            np.testing.assert_array_equal(np.asarray(got), want.numpy())
    assert int(o1.iterations) > 0


def test_ema_reference_is_keras_per_step_ema(digits):
    """With one step per push the reference rule is Keras's own EMA: checked
    against plain Keras step by step (6 steps, momentum 0.9)."""
    (x, y), _ = _flat(digits)
    keras.utils.set_random_seed(0)
    model = _mlp()
    model.compile(keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9), LOSS)
    record = _Record(per_epoch=False)
    model.fit(
        x[:192], y[:192], batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[record]
    )
    for got, want in zip(record.average, _ema_reference(record.central, [1] * 6, 0.9)):
        _assert_close(got, want)
