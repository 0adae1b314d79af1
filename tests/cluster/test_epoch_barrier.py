"""Windows across epoch ends (`epoch_barrier=False`) on a real loopback cluster: the
workers go on with the next epoch's windows while Keras ends the epoch, every window is
still applied exactly once, and the fit's last epoch (or one after which training stops)
waits for all of them; with the barrier (the default) no window starts before the
epoch before it has finished."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_asgd

from helpers import dense_digits_model

pytestmark = pytest.mark.usefixtures("hang_guard")

N_SYNC, EPOCHS = 5, 8


def _fit(cluster, digits, barrier, callbacks=()):
    """EPOCHS epochs of one window each (steps_per_epoch = n_sync) on 4 workers."""
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver,
        n_sync=N_SYNC,
        epoch_barrier=barrier,
        per_worker_dataset_fn=tf_asgd.data.emulated_device_time(40),
    )
    model = dense_digits_model(strategy, seed=4)
    (x, y), _ = digits
    history = model.fit(
        x, y, batch_size=32, epochs=EPOCHS, steps_per_epoch=N_SYNC, callbacks=list(callbacks)
    )
    return strategy, model, history


def _most_at_once(log):
    """The most windows running at one moment (by the workers' clocks)."""
    return max(sum(r.started_at <= t.started_at < r.finished_at for r in log) for t in log)


def test_without_the_barrier_the_next_epochs_windows_run_while_an_epoch_ends(local_cluster, digits):
    cluster = local_cluster(4)
    strategy, model, history = _fit(cluster, digits, barrier=False)
    assert len(history.history["loss"]) == EPOCHS
    # Each epoch's logs are those of windows finished by its end: never the zeros of none.
    assert all(loss > 0 for loss in history.history["loss"]), history.history
    log = strategy.window_log(model)
    stats = strategy.model_stats(model)
    # Every window applied once, all of them recorded when fit returns (the last epoch waited).
    assert sorted(r.window_id for r in log) == list(range(EPOCHS))
    assert stats.applied == stats.windows == EPOCHS
    assert _most_at_once(log) >= 2, [(r.started_at, r.finished_at) for r in log]
    assert len({r.worker for r in log}) > 1


def test_with_the_barrier_each_epochs_window_starts_after_the_last_finished(local_cluster, digits):
    cluster = local_cluster(4)
    strategy, model, _ = _fit(cluster, digits, barrier=True)
    log = strategy.window_log(model)
    assert len(log) == EPOCHS and _most_at_once(log) == 1


def test_a_stop_after_an_epoch_without_the_barrier_leaves_nothing_running(local_cluster, digits):
    """A callback that stops training at an epoch's end, after the epoch ended without
    waiting: `fit` returns with every window it scheduled applied and recorded."""

    class StopAfter(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = epoch >= 2

    cluster = local_cluster(4)
    strategy, model, history = _fit(cluster, digits, barrier=False, callbacks=[StopAfter()])
    assert len(history.history["loss"]) == 3
    stats = strategy.model_stats(model)
    assert stats.applied == stats.windows == len(strategy.window_log(model)) == 3
    assert np.isfinite(history.history["loss"]).all()


def test_epoch_barrier_is_validated_before_connecting():
    cluster = tf.train.ClusterSpec({"ps": ["localhost:1"], "worker": ["localhost:2"]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
    for bad in (0, 1, None, "False"):
        with pytest.raises(ValueError, match="epoch_barrier must be True or False"):
            tf_asgd.AsyncParameterServerStrategy(resolver, epoch_barrier=bad)
    with pytest.raises(ValueError, match="epoch_barrier=False needs asynchronous windows"):
        tf_asgd.AsyncParameterServerStrategy(resolver, epoch_barrier=False, synchronous=True)
