"""A push held at a named point (`cluster.fault_points`) while its worker is SIGKILLed:
what reaches each PS. 1 worker, 2 PS with the dense kernel split over both, and one batch
repeated and plain SGD, so that the run is deterministic and a fault-free run is its reference."""

import logging
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_asgd
from tf_asgd.cluster import fault_points
from tf_asgd.runtime import ps_recovery

from helpers import dense_digits_model

pytestmark = pytest.mark.usefixtures("hang_guard")

EPOCHS, STEPS, N_SYNC = 3, 20, 2
WINDOWS = EPOCHS * STEPS // N_SYNC


def _fit(strategy, digits):
    (x, y), _ = digits
    # Plain SGD: the restarted worker's own optimizer state (none) cannot differ.
    model = dense_digits_model(strategy, optimizer=keras.optimizers.SGD(0.05), seed=1)
    batch = tf.data.Dataset.from_tensors((x[:32], y[:32])).repeat()
    model.fit(batch, epochs=EPOCHS, steps_per_epoch=STEPS, verbose=0)
    return model


def _strategy(cluster, synchronous=False):
    """1 worker, 2 PS, the dense kernel split over both."""
    return tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver,
        n_sync=N_SYNC,
        variable_partitioner=tf.distribute.experimental.partitioners.MaxSizePartitioner(
            max_shard_bytes=1024
        ),
        connect_timeout=120,
        synchronous=synchronous,
    )


def _kill_in_the_hold(cluster, strategy, held, events):
    """A thread that SIGKILLs worker:0 1 s after push `held` took its ticket, and
    restarts it 1 s later."""

    def kill():
        while int(strategy.counters.version.numpy()) <= held:  # its ticket is taken
            time.sleep(0.05)
        time.sleep(1.0)
        cluster.kill_task("worker:0")
        events["killed"] = time.monotonic()
        time.sleep(1.0)
        cluster.restart_task("worker:0")

    return threading.Thread(target=kill, daemon=True)


@pytest.mark.parametrize("point", fault_points.POINTS)
def test_a_push_cut_at_each_point_is_applied_exactly_once(local_cluster, digits, point):
    """The 4th push of a `fit` waits 6 s at `point`; its worker is SIGKILLed 1 s into
    that wait and restarted. Between the PS tasks' writes (after the counters' PS, ps:0,
    took the ticket and made its own writes), TF cancels ps:1's part of the dead worker's
    function: ps:1's writes are never made (on the code before `commits`, the model
    stayed so, and the window's rerun found its id applied and pushed nothing). The chief
    sees the replay, finds ps:1 a push behind ps:0 (`commits.PushCommits`), and goes back
    to the snapshot; the windows since train again. After the ticket, and after the last
    write, the push is whole or undone as well. The central weights then equal a
    fault-free run's, to float rounding: each push applied exactly once on both PS."""
    with local_cluster(1, 2, own=True, shared_process=False) as cluster:
        strategy = _strategy(cluster)
        reference = [w.numpy() for w in _fit(strategy, digits).weights]
        held = int(strategy.counters.version.numpy()) + 3
        events = {}
        thread = _kill_in_the_hold(cluster, strategy, held, events)
        with fault_points.armed(point, 6.0, ticket=held):
            thread.start()
            model = _fit(strategy, digits)
        thread.join()
        assert "killed" in events
        stats = strategy.model_stats(model)  # the strategy's counters: both fits
        assert stats.applied == int(strategy.counters.version.numpy()) == 2 * WINDOWS
        log = strategy.window_log(model)
        # The held window's first run was lost with its worker; its rerun found its id
        # applied and pushed nothing; the chief then found ps:1 a push behind and went
        # back to the snapshot, and the windows since trained again, each applied once.
        if point != "after_last_write":  # (there the push is whole: its rerun a replay)
            (recovery,) = strategy.recoveries
            assert "a push cut before every parameter server wrote it" in recovery.lost[0]
            behind = "ps:1 behind" if point == "between_ps_writes" else "ps:0, ps:1 behind"
            assert behind in recovery.lost[0]
        live = [r for r in log if not r.rolled_back]
        applied = [r.window_id for r in live if r.pushed and not r.replayed]
        assert len(applied) == len(set(applied))  # none twice
        # A window whose push was whole before its worker died shows only as a replay.
        replayed = {r.window_id for r in live if r.replayed}
        assert sorted(set(applied) | replayed) == list(range(WINDOWS))  # none lost
        shards = {s.device for w in model.weights for s in getattr(w.value, "variables", [])}
        assert len(shards) == 2  # the kernel is on both PS
        for got, want in zip(model.weights, reference):
            np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


class _OnGoBack(logging.Handler):
    """Calls `action` once, when the chief logs that it goes back to the snapshot for a
    cut push: inside that go-back, before its first write."""

    def __init__(self, action):
        super().__init__()
        self.action, self.done = action, False

    def emit(self, record):
        text = record.getMessage()
        if not self.done and "a push cut" in text and "going back to the snap" in text:
            self.done = True
            self.action()


def _restart(cluster, task):
    cluster.kill_task(task)
    cluster.restart_task(task)


def _fit_cutting_a_push(cluster, strategy, digits, handler, caplog):
    """`_fit` with its 4th push held between the PS tasks' writes and its worker killed
    there (as above), and `handler` on the `tf_asgd` log; returns the model."""
    held = int(strategy.counters.version.numpy()) + 3
    thread = _kill_in_the_hold(cluster, strategy, held, {})
    logging.getLogger("tf_asgd").addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger="tf_asgd"):
            with fault_points.armed("between_ps_writes", 6.0, ticket=held):
                thread.start()
                model = _fit(strategy, digits)
    finally:
        logging.getLogger("tf_asgd").removeHandler(handler)
    thread.join()
    return model


def _assert_gone_back_again_for_ps0(strategy, model, reference, log_text):
    """A first go-back failed and a second, for ps:0 lost, recovered: every window applied
    once, and the central weights equal to the fault-free run's `reference`."""
    assert "Could not go back to the snapshot" in log_text  # the first attempt
    assert any("ps:0" in task for task in strategy.recoveries[-1].lost)  # the second
    _assert_each_push_once(strategy, model, reference)


def _assert_each_push_once(strategy, model, reference):
    """Every window applied once, and the central weights equal the fault-free run's."""
    assert int(strategy.counters.version.numpy()) == 2 * WINDOWS
    log = [r for r in strategy.window_log(model) if not r.rolled_back]
    applied = [r.window_id for r in log if r.pushed and not r.replayed]
    assert len(applied) == len(set(applied))  # none twice
    assert sorted(set(applied) | {r.window_id for r in log if r.replayed}) == list(range(WINDOWS))
    for got, want in zip(model.weights, reference):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("synchronous", [False, True], ids=["asynchronous", "rounds"])
def test_a_repair_whose_go_back_fails_goes_back_again(local_cluster, digits, caplog, synchronous):
    """The push cut between the PS tasks' writes, as above; then, as the chief goes back
    to the snapshot to repair it, ps:0 (the counters' PS) is SIGKILLed and restarted on
    its port. That go-back's writes to ps:0 fail: its new server knows nothing of this
    chief's context. The chief goes back again (`PSRecovery._go_back_again`), now for
    ps:0 lost, so it reconnects first. The
    fit completes, each push applied once: the central weights equal a fault-free run's.
    (A repair that tried once stopped `fit` with "Training stopped: a push cut ...").
    Rounds likewise: the attempt that restores the snapshot runs them again."""
    with local_cluster(1, 2, own=True, shared_process=False) as cluster:
        strategy = _strategy(cluster, synchronous)
        reference = [w.numpy() for w in _fit(strategy, digits).weights]
        restart = _OnGoBack(lambda: _restart(cluster, "ps:0"))
        model = _fit_cutting_a_push(cluster, strategy, digits, restart, caplog)
        assert restart.done
        _assert_gone_back_again_for_ps0(strategy, model, reference, caplog.text)


def _fit_restarting_in_the_go_back(cluster, strategy, digits, caplog, monkeypatch, task):
    """`_fit_cutting_a_push`, with `task` SIGKILLed as the repair's first go-back (after its
    writes) waits for every worker to read the PS, and restarted 1.5 s later."""
    reach_workers, restarts = ps_recovery._reach_workers, []

    def reach_workers_restarting(*args):
        if armed.done and not restarts:
            cluster.kill_task(task)
            restarts.append(threading.Timer(1.5, cluster.restart_task, args=(task,)))
            restarts[0].start()
        return reach_workers(*args)

    monkeypatch.setattr(ps_recovery, "_reach_workers", reach_workers_restarting)
    armed = _OnGoBack(lambda: None)
    model = _fit_cutting_a_push(cluster, strategy, digits, armed, caplog)
    assert restarts, f"{task} was not restarted in a go-back"
    restarts[0].join()
    return model


@pytest.mark.parametrize("synchronous", [False, True], ids=["asynchronous", "rounds"])
def test_a_ps_lost_as_a_go_back_reaches_the_workers_is_gone_back_for_at_once(
    local_cluster, digits, caplog, monkeypatch, synchronous
):
    """The push cut between the PS tasks' writes, as above. The chief's go-back writes the
    snapshot's values; then, as it waits for every worker to read the PS again, ps:0 is
    SIGKILLed, and restarted 1.5 s later. The workers' reads fail with TF's "Unable to
    find a context_id": ps:0's new server knows nothing of this chief's context, and no
    wait changes that. The attempt fails at once, and the chief goes back again, for ps:0
    lost, reconnecting first. (Waiting there until `connect_timeout` passed stopped `fit`
    with "Training stopped: a push cut ...; connect_timeout passed before every worker read
    the PS again".) Each push is applied once: the central weights equal a fault-free run's."""
    with local_cluster(1, 2, own=True, shared_process=False) as cluster:
        strategy = _strategy(cluster, synchronous)
        reference = [w.numpy() for w in _fit(strategy, digits).weights]
        model = _fit_restarting_in_the_go_back(
            cluster, strategy, digits, caplog, monkeypatch, "ps:0"
        )
        _assert_gone_back_again_for_ps0(strategy, model, reference, caplog.text)


@pytest.mark.parametrize("synchronous", [False, True], ids=["asynchronous", "rounds"])
def test_a_worker_restarted_as_a_go_back_reaches_it_leaves_each_push_applied_once(
    local_cluster, digits, caplog, monkeypatch, synchronous
):
    """As above, but no PS is touched: the worker is SIGKILLed as the repair's go-back
    waits for it to read the PS, and restarted 1.5 s later. TF's coordinator reconnects
    the restarted worker; the fit completes with no PS recovered beyond the repair, and
    each push is applied once: the central weights equal a fault-free run's."""
    with local_cluster(1, 2, own=True, shared_process=False) as cluster:
        strategy = _strategy(cluster, synchronous)
        reference = [w.numpy() for w in _fit(strategy, digits).weights]
        model = _fit_restarting_in_the_go_back(
            cluster, strategy, digits, caplog, monkeypatch, "worker:0"
        )
        assert "Lost parameter server" not in caplog.text  # no PS taken as lost
        _assert_each_push_once(strategy, model, reference)
