"""A parameter server lost during `fit` is recovered inside `fit` (`ps_recovery`): the
run completes, every window is applied exactly once, the log reports the rollback, and
where recovery is impossible `fit` stops with the clear error within its bound."""

import logging
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_asgd

from helpers import KillTask, dense_digits_model
from launching import alive

pytestmark = pytest.mark.usefixtures("hang_guard")

EPOCHS, STEPS, N_SYNC = 10, 40, 5


def _sharded_strategy(cluster, **options):
    """2 PS tasks with each large variable split over both (a shard per 1 KiB)."""
    partitioner = tf.distribute.experimental.partitioners.MaxSizePartitioner(max_shard_bytes=1024)
    return tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver,
        n_sync=N_SYNC,
        variable_partitioner=partitioner,
        per_worker_dataset_fn=tf_asgd.data.emulated_device_time(20),
        **options,
    )


def _fit(model, digits, callbacks=()):
    (x, y), (xt, yt) = digits
    history = model.fit(
        x,
        y,
        batch_size=32,
        epochs=EPOCHS,
        steps_per_epoch=STEPS,
        callbacks=list(callbacks),
        verbose=0,
    )
    return history, model.evaluate(xt, yt, verbose=0)[1]


def test_a_ps_killed_mid_fit_and_restarted_is_recovered_and_fit_completes(
    local_cluster, digits, caplog
):
    """2 workers, 2 PS, a variable split over both; ps:0 SIGKILLed mid-`fit` and restarted
    2 s later: `fit` completes every epoch with no user action; one recovery, logged with
    its rollback; every window of the fit is applied exactly once (`version` equals the
    pushes applied, and the applied window ids are the fit's ids, each once); held-out
    accuracy at most 3 points below a fault-free run on the same cluster (two fault-free
    runs differ by up to about 1, more under load)."""
    with local_cluster(2, 2, own=True, shared_process=False) as cluster:
        pids = cluster.pids()
        strategy = _sharded_strategy(cluster, snapshot_every=1.0)
        model = dense_digits_model(strategy, seed=1)
        assert any(len(getattr(v.value, "variables", [])) > 1 for v in model.weights)  # sharded
        kill = KillTask(cluster, "ps:0", at=25)
        with caplog.at_level(logging.WARNING, logger="tf_asgd"):
            history, faulted = _fit(model, digits, [kill])
        assert "restarted" in kill.events, kill.events
        assert len(history.history["loss"]) == EPOCHS
        (recovery,) = strategy.recoveries
        assert recovery.lost[0].startswith("ps:0 (") and recovery.waited_s < 30
        assert 0 < recovery.rolled_back + recovery.in_flight
        assert any("Recovered parameter server ps:0" in r.message for r in caplog.records)
        assert any(
            f"{recovery.rolled_back} push(es) rolled back" in r.message for r in caplog.records
        )

        stats = strategy.model_stats(model)
        version = int(strategy.counters.version.numpy())
        assert stats.windows == stats.applied == version == EPOCHS * STEPS // N_SYNC
        log = strategy.window_log(model)
        applied = [r.window_id for r in log if r.pushed and not r.replayed and not r.rolled_back]
        assert sorted(applied) == list(range(EPOCHS * STEPS // N_SYNC))  # each once
        assert sum(r.rolled_back for r in log) >= recovery.rolled_back

        # The same fit without a fault, on the same cluster (the counters go on).
        free = dense_digits_model(strategy, seed=1)
        _, fault_free = _fit(free, digits)
        # Two fault-free runs of one seed differ by up to about a point (asynchronous
        # training is not deterministic), more on a loaded machine: 2.2 points once with
        # the suite's other cluster beside it, and a fault-free run once ended 3.1 below
        # the faulted one. What the recovery must not do is cost accuracy, so the check is
        # one-sided. The 3-seed grid is results/ps_recovery's.
        assert fault_free - faulted <= 0.03, (faulted, fault_free)
        assert faulted > 0.9
    assert not [p for p in pids.values() if alive(p)]


def test_the_rolled_back_epochs_train_again_epoch_by_epoch(local_cluster, digits, monkeypatch):
    """A loss rolled back to the fit's start (one snapshot there): the windows of the
    epochs before the running one train again as they first ran, each epoch's started
    only once the one before it has finished (the epoch's end they ran under), so a
    recovered fit trains as the fault-free one would. Each window is applied once."""
    monkeypatch.setattr(tf_asgd.runtime.ps_recovery, "SNAPSHOT_BUDGET", 1e-12)  # only at 0
    per_epoch = STEPS // N_SYNC
    with local_cluster(2, 2, own=True, shared_process=False) as cluster:
        strategy = _sharded_strategy(cluster)
        model = dense_digits_model(strategy, seed=3)
        kill = KillTask(cluster, "ps:0", at=3 * per_epoch + 2)
        history, accuracy = _fit(model, digits, [kill])
        assert len(history.history["loss"]) == EPOCHS and accuracy > 0.9
        (recovery,) = strategy.recoveries
        assert recovery.version == 0 and recovery.rolled_back >= 2 * per_epoch
        log = strategy.window_log(model)
        applied = [r for r in log if r.pushed and not r.replayed and not r.rolled_back]
        assert sorted(r.window_id for r in applied) == list(range(EPOCHS * per_epoch))
        rolled = {r.window_id for r in log if r.rolled_back}
        again = {}  # epoch -> its rolled-back windows' second runs
        for r in applied:
            if r.window_id in rolled:
                again.setdefault(r.window_id // per_epoch, []).append(r)
        earlier = sorted(e for e in again if e < 3)
        assert earlier[:2] == [0, 1], sorted(again)
        for before, after in zip(earlier, earlier[1:]):
            assert max(r.finished_at for r in again[before]) <= min(
                r.started_at for r in again[after]
            ), (before, after)


def test_a_ps_lost_in_the_last_epochs_callbacks_is_recovered_and_its_windows_train(
    local_cluster, digits, monkeypatch
):
    """ps:0 killed and restarted in the last epoch's `on_epoch_end`, then a central
    variable read there: the callback meets the lost PS, is called again after the
    recovery, and the windows the recovery rolled back (every one: the only snapshot is
    the fit's start) train again before `fit` returns, each applied once."""
    monkeypatch.setattr(tf_asgd.runtime.ps_recovery, "SNAPSHOT_BUDGET", 1e-12)  # only at 0

    class KillThenRead(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def on_epoch_end(self, epoch, logs=None):
            if epoch != EPOCHS - 1:
                return
            self.calls += 1
            if self.calls == 1:
                cluster.kill_task("ps:0")
                time.sleep(2.0)
                cluster.restart_task("ps:0")
            self.model.get_weights()  # reads ps:0: raises on the first call

    with local_cluster(2, 2, own=True, shared_process=False) as cluster:
        strategy = _sharded_strategy(cluster)
        model = dense_digits_model(strategy, seed=5)
        callback = KillThenRead()
        history, accuracy = _fit(model, digits, [callback])
        assert len(history.history["loss"]) == EPOCHS and callback.calls == 2
        (recovery,) = strategy.recoveries
        windows = EPOCHS * STEPS // N_SYNC
        assert recovery.version == 0 and recovery.rolled_back == windows
        stats = strategy.model_stats(model)
        assert stats.applied == int(strategy.counters.version.numpy()) == windows
        log = strategy.window_log(model)
        applied = [r.window_id for r in log if r.pushed and not r.replayed and not r.rolled_back]
        assert sorted(applied) == list(range(windows))
        assert accuracy > 0.9


def test_a_ps_lost_between_epochs_is_recovered_at_the_next_epochs_start(local_cluster, digits):
    """ps:0 killed and restarted at an epoch's end, after every callback has read it: the
    next epoch's start (Keras resetting the metrics, then the windows) meets the lost PS,
    recovers it, and `fit` completes with each window applied once."""

    class KillAtEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 1:
                cluster.kill_task("ps:0")
                time.sleep(2.0)
                cluster.restart_task("ps:0")

    with local_cluster(2, 2, own=True, shared_process=False) as cluster:
        strategy = _sharded_strategy(cluster)
        model = dense_digits_model(strategy, seed=6)
        history, accuracy = _fit(model, digits, [KillAtEpochEnd()])
        assert len(history.history["loss"]) == EPOCHS
        assert len(strategy.recoveries) == 1
        stats = strategy.model_stats(model)
        assert stats.applied == int(strategy.counters.version.numpy()) == EPOCHS * STEPS // N_SYNC
        log = strategy.window_log(model)
        applied = [r.window_id for r in log if r.pushed and not r.replayed and not r.rolled_back]
        assert sorted(applied) == list(range(EPOCHS * STEPS // N_SYNC))
        assert accuracy > 0.9


@pytest.mark.parametrize("synchronous", [False, True], ids=["asynchronous", "synchronous"])
def test_a_ps_lost_between_fits_is_recovered_at_the_next_fits_start(
    local_cluster, digits, caplog, synchronous
):
    """A loop of `fit`s, asynchronous or in synchronous rounds: ps:0 killed and restarted after the
    first `fit` has returned. The second `fit` meets the lost PS at its start, goes back to
    the snapshot of the first fit's end (nothing of it rolled back), and completes: each
    window of both fits applied once, and the model is where the first fit left it, then
    trained on. A snapshot that lacks a central variable made since is not gone back to:
    `fit` stops with the named error, nothing restored."""
    fits, epochs = 2, 3
    windows = epochs * STEPS // N_SYNC
    with local_cluster(2, 2, own=True, shared_process=False) as cluster:
        strategy = _sharded_strategy(cluster, synchronous=synchronous)
        model = dense_digits_model(strategy, seed=7)
        (x, y), (xt, yt) = digits
        for fit in range(fits):
            if fit:
                cluster.kill_task("ps:0")
                time.sleep(2.0)
                cluster.restart_task("ps:0")
            history = model.fit(
                x, y, batch_size=32, epochs=epochs, steps_per_epoch=STEPS, verbose=0
            )
            assert len(history.history["loss"]) == epochs
        (recovery,) = strategy.recoveries
        assert recovery.lost[0].startswith("ps:0 (")
        assert recovery.rolled_back == recovery.in_flight == 0
        assert recovery.version == windows  # the first fit's end, kept whole
        assert int(strategy.counters.version.numpy()) == fits * windows
        assert int(model.optimizer.iterations.numpy()) == fits * windows * N_SYNC
        log = strategy.window_log(model)
        applied = [r.window_id for r in log if r.pushed and not r.replayed and not r.rolled_back]
        assert sorted(applied) == list(range(fits * windows))  # each once
        assert model.evaluate(xt, yt, verbose=0)[1] > 0.9

        with strategy.scope():  # a central variable the snapshot of the fit's end lacks
            extra = tf.Variable(1.0)
        cluster.kill_task("ps:0")
        time.sleep(2.0)
        cluster.restart_task("ps:0")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tf_asgd"):
            with pytest.raises(tf_asgd.ClusterTaskLostError, match="ps:0"):
                model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=STEPS, verbose=0)
        assert not any("Lost parameter server" in r.message for r in caplog.records), extra
        assert len(strategy.recoveries) == 1


def test_a_ps_lost_in_synchronous_mode_is_recovered_and_its_rounds_run_again_whole(
    local_cluster, digits
):
    """`synchronous=True`: ps:0 SIGKILLed mid-`fit` and restarted 2 s later. The snapshot is
    taken at a round's barrier, so the recovery reruns every round since it whole: each
    applied round's N windows start from its round start (staleness 0, as rounds
    count it), and each round starts once the one before has finished; every window is
    applied once, and held-out accuracy is within 2 points of a fault-free run."""
    workers = 2
    with local_cluster(workers, 2, own=True, shared_process=False) as cluster:
        strategy = _sharded_strategy(cluster, snapshot_every=1.0, synchronous=True)
        model = dense_digits_model(strategy, seed=4)
        kill = KillTask(cluster, "ps:0", at=25)
        history, faulted = _fit(model, digits, [kill])
        assert len(history.history["loss"]) == EPOCHS
        (recovery,) = strategy.recoveries
        assert 0 < recovery.rolled_back + recovery.in_flight
        windows = EPOCHS * STEPS // N_SYNC
        stats = strategy.model_stats(model)
        assert stats.applied == int(strategy.counters.version.numpy()) == windows
        log = strategy.window_log(model)
        applied = [r for r in log if r.pushed and not r.replayed and not r.rolled_back]
        assert sorted(r.window_id for r in applied) == list(range(windows))  # each once
        by_round = {}
        for r in applied:
            by_round.setdefault(r.window_id // workers, []).append(r)
        for k, rs in sorted(by_round.items()):
            assert len(rs) == workers and all(r.staleness == 0 for r in rs), (k, rs)
            if k + 1 in by_round:
                assert max(r.finished_at for r in rs) <= min(
                    r.started_at for r in by_round[k + 1]
                ), k

        free = dense_digits_model(strategy, seed=4)
        _, fault_free = _fit(free, digits)
        assert fault_free - faulted <= 0.02, (faulted, fault_free)  # the recovery costs none
        assert faulted > 0.9


def test_a_ps_that_does_not_come_back_stops_fit_within_the_bound(local_cluster, digits):
    """ps:0 SIGKILLed mid-`fit` and never restarted, `connect_timeout=5`: `fit` raises
    `ClusterTaskLostError` naming ps:0, within the bound plus the time to notice."""
    with local_cluster(2, 2, own=True, shared_process=False) as cluster:
        strategy = _sharded_strategy(cluster, snapshot_every=1.0, connect_timeout=5)
        model = dense_digits_model(strategy, seed=2)
        kill = KillTask(cluster, "ps:0", at=10, after=None)
        with pytest.raises(tf_asgd.ClusterTaskLostError) as info:
            _fit(model, digits, [kill])
        assert time.monotonic() - kill.events["killed"] < 5 + 25
        assert "ps:0" in str(info.value) and "--resume" in str(info.value)
        assert not strategy.recoveries


def test_snapshot_every_is_validated_before_connecting():
    cluster = tf.train.ClusterSpec({"ps": ["localhost:1"], "worker": ["localhost:2"]})
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(cluster, rpc_layer="grpc")
    for bad in (0, -1.0, float("inf"), True, "60"):
        with pytest.raises(ValueError, match="snapshot_every"):
            tf_asgd.AsyncParameterServerStrategy(resolver, snapshot_every=bad)
    assert np.isfinite(tf_asgd.runtime.ps_recovery.DEFAULT_SNAPSHOT_EVERY)
