"""BatchNormalization's moving statistics under windows: they move as far as in plain
Keras over the same global steps (`update_rules.moving_average_gain` on the PS), in
asynchronous and synchronous mode, on a real loopback cluster."""

import keras
import numpy as np
import pytest

import tf_asgd

STEPS, MOMENTUM = 100, 0.99


@pytest.mark.parametrize("synchronous", [False, True], ids=["asynchronous", "synchronous"])
def test_moving_mean_moves_as_far_as_in_plain_keras(cluster, synchronous):
    """Features of mean 5 and variance 4, `SGD(0)` (only the statistics move): after
    100 global steps on 2 workers the moving mean and variance are within 5% of plain
    Keras's after its 100 steps on the same batches. The outer rate alone (1/2) left the
    mean at about 2.0 of plain's 3.2, as if half the steps had run."""
    x = (np.random.default_rng(0).normal(size=(STEPS * 32, 4)) * 2.0 + 5.0).astype("float32")
    y = np.zeros((len(x), 1), "float32")

    def build():
        bn = keras.layers.BatchNormalization(momentum=MOMENTUM)
        model = keras.Sequential([keras.Input((4,)), bn, keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.0), "mse")
        return model, bn

    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=10, synchronous=synchronous
    )
    with strategy.scope():
        model, bn = build()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    assert int(model.optimizer.iterations.numpy()) == STEPS
    plain, plain_bn = build()  # plain Keras, on the chief
    plain.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False)
    assert plain_bn.moving_mean.numpy().min() > 3.0  # it moved: 5 (1 - 0.99^100) = 3.17
    np.testing.assert_allclose(bn.moving_mean.numpy(), plain_bn.moving_mean.numpy(), rtol=0.05)
    np.testing.assert_allclose(
        bn.moving_variance.numpy(), plain_bn.moving_variance.numpy(), rtol=0.05
    )
