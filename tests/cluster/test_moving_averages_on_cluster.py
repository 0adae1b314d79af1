"""BatchNormalization's moving statistics under windows: they move as far as in plain
Keras over the same global steps (`outer_optimizers.moving_average_push` on the PS), in
asynchronous and synchronous mode, and a stale push leaves a variance above 0, on a real
loopback cluster."""

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


def test_a_falling_variance_stays_above_zero_under_stale_pushes(local_cluster):
    """Features of variance 1e-4 pull the moving variance down from 1 at momentum 0.5; 4
    workers push windows pulled before the others' pushes landed. Each push is applied
    from where the variance stands (`outer_optimizers.moving_average_push`): it never goes
    below 0, and ends where plain Keras's does. Added as they were, such pushes took it
    below 0, and the held-out loss was NaN."""
    x = (np.random.default_rng(1).normal(size=(STEPS * 32, 4)) * 0.01).astype("float32")
    y = np.zeros((len(x), 1), "float32")

    class Lowest(keras.callbacks.Callback):
        lowest = np.inf

        def on_train_batch_end(self, batch, logs=None):
            self.lowest = min(self.lowest, float(bn.moving_variance.numpy().min()))

    with local_cluster(4, own=True, shared_process=False) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)
        with strategy.scope():
            bn = keras.layers.BatchNormalization(momentum=0.5)
            model = keras.Sequential([keras.Input((4,)), bn, keras.layers.Dense(1)])
            model.compile(keras.optimizers.SGD(0.0), "mse")
        lowest = Lowest()
        model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[lowest])
        assert strategy.model_stats(model).max_staleness >= 1  # pushes were stale
        variance = bn.moving_variance.numpy()
    assert lowest.lowest >= 0.0 and variance.min() > 0.0
    np.testing.assert_allclose(variance, x.var(axis=0), rtol=0.5)
