"""Connecting to a cluster is bounded: tasks that do not answer within
`connect_timeout` raise `ClusterUnreachableError` naming each of them, and
nothing of the strategy is left behind; tasks that start a little later are
waited for."""

import contextlib
import logging
import os
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

import tf_asgd
from tf_asgd.cluster import connect
from tf_asgd.cluster.ports import pick_ports
from tf_asgd.cluster.tf_config import make_resolver

from helpers import linear_digits_model

TIMEOUT = 3.0
SLACK = 10.0  # what the bound may be overrun by: one probe round, a loaded machine


def _coordinator_threads():
    return [t for t in threading.enumerate() if t.name.startswith("WorkerClosureProcessingLoop")]


def _alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _connect_fails(resolver, caplog):
    """Creates a strategy that must fail; returns (error, seconds)."""
    threads, devices = len(_coordinator_threads()), tf.config.list_logical_devices()
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="tf_asgd"):
        with pytest.raises(tf_asgd.ClusterUnreachableError) as info:
            tf_asgd.AsyncParameterServerStrategy(resolver, n_sync=2, connect_timeout=TIMEOUT)
    secs = time.perf_counter() - t0
    # Nothing half-built: no coordinator thread, this process not connected.
    assert len(_coordinator_threads()) == threads
    assert tf.config.list_logical_devices() == devices
    return info.value, secs


def test_a_cluster_that_never_started_raises_within_the_bound(caplog):
    chief, ps, w0, w1 = pick_ports(4)  # nothing listens on them
    spec = {
        "chief": [f"localhost:{chief}"],
        "ps": [f"localhost:{ps}"],
        "worker": [f"localhost:{w0}", f"localhost:{w1}"],
    }
    error, secs = _connect_fails(make_resolver(spec), caplog)
    print(f"never-started cluster: raised after {secs:.2f} s (connect_timeout {TIMEOUT:g} s)")
    assert TIMEOUT - 0.1 <= secs < TIMEOUT + SLACK
    message = str(error)
    for task, port in (("ps:0", ps), ("worker:0", w0), ("worker:1", w1)):
        assert f"{task} at localhost:{port} (Connection refused)" in message
    assert f"localhost:{chief}" not in message  # the chief is this process
    assert sorted(t[:3] for t in error.tasks) == [
        ("ps", 0, f"localhost:{ps}"),
        ("worker", 0, f"localhost:{w0}"),
        ("worker", 1, f"localhost:{w1}"),
    ]
    assert isinstance(error, ConnectionError) and error.timeout == TIMEOUT
    waiting = [r.getMessage() for r in caplog.records if r.name == "tf_asgd"]
    assert waiting and all("Waiting for 3 of 3 cluster task(s)" in m for m in waiting)
    assert f"ps:0 at localhost:{ps}" in waiting[0]
    assert (
        len(waiting) <= 1 + TIMEOUT // connect.LOG_FIRST_EVERY_SECS
    )  # at most one line per interval


def test_a_cluster_whose_ps_was_killed_raises_naming_the_ps(local_cluster, caplog):
    with local_cluster(1, 1, own=True, shared_process=False) as cluster:
        pids = cluster.pids()
        cluster.kill_task("ps:0")
        error, secs = _connect_fails(cluster.resolver, caplog)
    print(f"killed PS: raised after {secs:.2f} s (connect_timeout {TIMEOUT:g} s)")
    assert secs < TIMEOUT + SLACK
    ps = cluster.cluster_spec["ps"][0]
    assert [t[:3] for t in error.tasks] == [("ps", 0, ps)]
    assert f"Could not reach 1 cluster task(s) within {TIMEOUT:g} s: ps:0 at {ps}" in str(error)
    assert not any(_alive(pid) for pid in pids.values())  # the with block stopped every task


@contextlib.contextmanager
def _started_late(cluster, tasks, secs):
    """Kills `tasks` of `cluster`, then restarts them `secs` after entering; yields a
    dict whose "up" is the wall time (`time.time()`) they all answered. The thread is
    joined, and its error raised, on leaving."""
    for task in tasks:
        cluster.kill_task(task)
    events = {}

    def start_late():
        time.sleep(secs)
        try:
            for task in tasks:
                cluster.restart_task(task)
            events["up"] = time.time()
        except BaseException as e:  # reported by the main thread
            events["error"] = e

    helper = threading.Thread(target=start_late, daemon=True)
    helper.start()
    yield events
    helper.join(secs + 60)
    assert "error" not in events, events.get("error")


def test_a_worker_that_starts_late_is_waited_for_then_trains(local_cluster, digits, caplog):
    (x, y), _ = digits
    with local_cluster(1, 1, own=True, shared_process=False) as cluster:
        t0 = time.time()
        with _started_late(cluster, ["worker:0"], 1.5) as events:
            with caplog.at_level(logging.WARNING, logger="tf_asgd"):
                strategy = tf_asgd.AsyncParameterServerStrategy(
                    cluster.resolver, n_sync=2, connect_timeout=60
                )
            secs = time.time() - t0
        print(
            f"late worker: connected after {secs:.2f} s, the worker was up after "
            f"{events['up'] - t0:.2f} s"
        )
        assert secs >= 1.5
        lines = [r.getMessage() for r in caplog.records if r.name == "tf_asgd"]
        assert "Waiting for 1 of 2 cluster task(s)" in lines[0] and "worker:0" in lines[0]
        assert lines[-1].startswith("All 2 cluster task(s) answer after")
        model = linear_digits_model(strategy)
        history = model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=4, verbose=0)
        assert np.isfinite(history.history["loss"][0])
        assert [r.worker for r in strategy.window_log(model)] == [0, 0]


LATE_SECS = 75.0  # a slow cluster's start: pods pulling images, servers started over ssh


def test_a_cluster_that_comes_up_slowly_is_waited_for_with_only_n_sync(
    local_cluster, digits, caplog
):
    """Every ps and worker task starts listening 75 s after the chief begins building the
    strategy with the default `connect_timeout`: it waits, names the missing tasks within
    30 s and keeps saying so, then trains."""
    (x, y), _ = digits
    with local_cluster(2, 1, own=True, shared_process=False) as cluster:
        tasks = ["ps:0", "worker:0", "worker:1"]
        t0 = time.time()
        with _started_late(cluster, tasks, LATE_SECS) as events:
            with caplog.at_level(logging.WARNING, logger="tf_asgd"):
                strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=2)
        assert time.time() - t0 >= LATE_SECS
        lines = [(r.created - t0, r.getMessage()) for r in caplog.records if r.name == "tf_asgd"]
        waiting = [(t, m) for t, m in lines if m.startswith("Waiting for")]
        print(
            f"slow cluster: up after {events['up'] - t0:.1f} s; waiting lines at",
            [round(t, 1) for t, _ in waiting],
        )
        assert waiting[0][0] < 30
        for task in tasks:
            assert f"{task} at localhost:" in waiting[0][1]
        times = [t for t, _ in waiting] + [events["up"] - t0]
        assert max(b - a for a, b in zip(times, times[1:])) <= 30 + SLACK
        assert lines[-1][1].startswith("All 3 cluster task(s) answer after")
        model = linear_digits_model(strategy)
        history = model.fit(x, y, batch_size=32, epochs=1, steps_per_epoch=8, verbose=0)
        assert np.isfinite(history.history["loss"][0])
        assert strategy.model_stats(model).windows >= 1
