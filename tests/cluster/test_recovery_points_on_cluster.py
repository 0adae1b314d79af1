"""Faults at the points a user meets them, with 2 PS and a variable split over both: a PS
lost as `fit` begins, a PS lost while the workers read a user's `tf.data` pipeline,
workers killed and restarted with no PS touched, and an error that names a PS that still
holds its variables. Each `fit` completes with every window applied exactly once."""

import threading
import time

import keras
import pytest
import tensorflow as tf

import tf_asgd

from helpers import KillTask, dense_digits_model
from launching import alive

pytestmark = pytest.mark.usefixtures("hang_guard")

EPOCHS, STEPS, N_SYNC = 6, 40, 5
WINDOWS = EPOCHS * STEPS // N_SYNC


def _strategy(cluster, **options):
    """2 PS tasks, the dense kernel split over both (a shard per 1 KiB)."""
    partitioner = tf.distribute.experimental.partitioners.MaxSizePartitioner(max_shard_bytes=1024)
    return tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver,
        n_sync=N_SYNC,
        variable_partitioner=partitioner,
        per_worker_dataset_fn=tf_asgd.data.emulated_device_time(20),
        **options,
    )


def _pipeline(digits):
    """What a user's script hands to `fit`: a seeded shuffle, repeated, batched."""
    (x, y), _ = digits
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(len(x), seed=0).repeat().batch(32)


def _fit(model, digits, callbacks):
    history = model.fit(
        _pipeline(digits), epochs=EPOCHS, steps_per_epoch=STEPS, callbacks=callbacks, verbose=0
    )
    (_, _), (xt, yt) = digits
    return history, model.evaluate(xt, yt, verbose=0)[1]


def _assert_each_window_applied_once(strategy, model):
    stats = strategy.model_stats(model)
    assert stats.windows == stats.applied == int(strategy.counters.version.numpy()) == WINDOWS
    log = strategy.window_log(model)
    applied = [r.window_id for r in log if r.pushed and not r.replayed and not r.rolled_back]
    assert sorted(applied) == list(range(WINDOWS))


class _KillAtBegin(KillTask):
    """Kills `task` in `on_train_begin`, the first moment a user's callback can."""

    def on_train_begin(self, logs=None):
        self.windows = self.at
        self.on_train_batch_end(0)


@pytest.mark.parametrize("when", ["as_fit_begins", "mid_fit", "as_a_snapshot_is_due"])
def test_a_ps_lost_as_fit_begins_or_mid_fit_with_a_tf_data_pipeline_is_recovered(
    local_cluster, digits, when
):
    """ps:0 SIGKILLed in `on_train_begin` (before any push: the fit's first snapshot is
    taken before the callbacks begin) or after 12 windows, and restarted 2 s later; the
    workers read a user's `tf.data` pipeline, whose reads the loss cancels (each
    worker's iterator is made anew). One recovery; every window applied once. With a
    snapshot due at every window, the loss is met before the next window is queued:
    that window is queued after the recovery, not dropped."""
    with local_cluster(2, 2, own=True, shared_process=False) as cluster:
        pids = cluster.pids()
        every = 1e-3 if when == "as_a_snapshot_is_due" else 1.0
        strategy = _strategy(cluster, snapshot_every=every)
        model = dense_digits_model(strategy, seed=1)
        kill = (_KillAtBegin if when == "as_fit_begins" else KillTask)(cluster, "ps:0", at=12)
        history, accuracy = _fit(model, digits, [kill])
        assert "restarted" in kill.events, kill.events
        assert len(history.history["loss"]) == EPOCHS
        (recovery,) = strategy.recoveries
        assert recovery.lost[0].startswith("ps:0 (")
        if when == "as_fit_begins":
            assert recovery.rolled_back == 0 and recovery.version == 0
        _assert_each_window_applied_once(strategy, model)
        assert accuracy > 0.85
    assert not [p for p in pids.values() if alive(p)]


def test_workers_killed_and_restarted_roll_nothing_back(local_cluster, digits):
    """No PS touched: worker:0, then worker:1, SIGKILLed mid-`fit` and restarted on
    their ports 1 s later. TF reconnects with every task's new context; nothing is taken
    for a lost PS, nothing is rolled back, and every window is applied once."""
    with local_cluster(2, 2, own=True, shared_process=False) as cluster:
        strategy = _strategy(cluster)
        model = dense_digits_model(strategy, seed=2)
        done = []

        class Restarts(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch in (1, 3):
                    task = f"worker:{epoch // 2}"

                    def go():
                        cluster.kill_task(task)
                        time.sleep(1.0)
                        cluster.restart_task(task)
                        done.append(task)

                    threading.Thread(target=go, daemon=True).start()

        history, accuracy = _fit(model, digits, [Restarts()])
        assert done == ["worker:0", "worker:1"]
        assert len(history.history["loss"]) == EPOCHS
        assert strategy.recoveries == []
        _assert_each_window_applied_once(strategy, model)
        assert accuracy > 0.85


def test_an_error_naming_a_ps_that_still_holds_its_variables_rolls_nothing_back(
    local_cluster, digits, caplog
):
    """What a worker restarted mid-window makes TF say ("... /job:ps/replica:0/task:0 ...
    Perhaps the worker was restarted"), handed to the recovery mid-`fit`: every PS still
    holds its variables, so nothing is rolled back; the windows in flight train again,
    and none is applied twice."""
    with local_cluster(2, 2, own=True, shared_process=False) as cluster:
        strategy = _strategy(cluster)
        model = dense_digits_model(strategy, seed=3)
        said = []

        class Inject(keras.callbacks.Callback):
            def on_epoch_end(self, epoch, logs=None):
                if epoch == 2 and not said:
                    error = tf.errors.UnavailableError(
                        None,
                        None,
                        "Unable to find a context_id matching the specified one (1). "
                        "Perhaps the worker was restarted, or the context was GC'd? "
                        "[/job:ps/replica:0/task:0/device:CPU:0]",
                    )
                    trainer = strategy.model_states.get(model).trainer
                    said.append(strategy.ps_recovery.recover(error, trainer))

        history, accuracy = _fit(model, digits, [Inject()])
        assert said == [None] and strategy.recoveries == []
        assert "nothing is rolled back" in caplog.text
        assert len(history.history["loss"]) == EPOCHS
        _assert_each_window_applied_once(strategy, model)
        assert accuracy > 0.85
