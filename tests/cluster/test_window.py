"""The worker's side of a window (`runtime/window.py`) on real loopback clusters: a window
id that already pushed runs no steps and pushes nothing, and the worker state a window
keeps (`worker_state="keep"`) or starts from zero (`"reset"`)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_asgd

from helpers import compile_digits


def _strategy(cluster, **kwargs):
    return tf_asgd.AsyncParameterServerStrategy(cluster.resolver, **kwargs)


def _gem(lr=0.05):
    return tf_asgd.optimizers.GEM(keras.optimizers.SGD(lr, momentum=0.9), kappa=1.0)


@pytest.mark.usefixtures("hang_guard")  # a hang fails the test, not the suite (conftest.py)
def test_a_rerun_window_is_never_applied_twice(cluster, digits):
    """TF re-runs the closure of a worker that died; if that worker had pushed
    before dying, the re-run must not push again. Re-running a window id that
    already pushed (as the coordinator does) runs no steps and pushes nothing."""
    (x, y), _ = digits
    strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=5)
    with strategy.scope():
        model = compile_digits(tf_asgd.models.digits_convnet(), _gem())
    model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=20, verbose=0)
    trainer = strategy.model_states.ensure_trainer(model)
    version = strategy.stats().windows
    before = [v.numpy() for v in model.trainable_variables]
    steps = int(model.optimizer.iterations.numpy())
    iterator = iter(
        strategy.coordinator.create_per_worker_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
        )
    )

    next_id = trainer.next_window_id
    trainer.next_window_id = 2  # an id that pushed during fit: a re-run
    trainer.train_function(iterator)
    strategy.coordinator.join()
    trainer.drain(block=True)
    replay = trainer.window_log[-1]
    assert replay.replayed and replay.pushed
    assert strategy.stats().windows == version  # no ticket, no push
    assert int(model.optimizer.iterations.numpy()) == steps
    for b, v in zip(before, model.trainable_variables):
        np.testing.assert_array_equal(b, v.numpy())

    trainer.next_window_id = next_id  # a new window pushes as usual
    trainer.train_function(iterator)
    strategy.coordinator.join()
    trainer.drain(block=True)
    assert not trainer.window_log[-1].replayed and trainer.window_log[-1].pushed
    assert strategy.stats().windows == version + 1


@pytest.mark.parametrize("worker_state,momentum_seen", [("keep", 0.9), ("reset", 0.0)])
def test_one_worker_is_plain_keras_and_reset_restarts_the_momentum(
    local_cluster, worker_state, momentum_seen
):
    """One worker, windows of 3 steps: with `worker_state="keep"` training is
    exactly plain Keras `SGD(0.1, momentum=0.9)`; with `"reset"` each window
    starts the momentum from zero, which for windows of 1 step is plain SGD
    without momentum. The same batches in the same order, one pass per epoch."""
    cluster1 = local_cluster(1)
    rng = np.random.default_rng(3)
    x, t = rng.normal(size=(24, 3)).astype("float32"), rng.normal(size=(24, 2)).astype("float32")
    n_sync = 3 if worker_state == "keep" else 1
    strategy = _strategy(cluster1, n_sync=n_sync, worker_state=worker_state)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "mse")
    init = [v.numpy() for v in model.trainable_variables]
    model.fit(x, t, batch_size=8, epochs=4, shuffle=False, verbose=0)

    local = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    local.compile(keras.optimizers.SGD(0.1, momentum=momentum_seen), "mse")
    local.set_weights(init)
    local.fit(x, t, batch_size=8, epochs=4, shuffle=False, verbose=0)
    for got, want in zip(model.trainable_variables, local.trainable_variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 4 * 3
