"""A worker that TF's coordinator still marks failed while its thread no longer waits
for a reconnection (its recovery failed on a lost PS: TF raised the PS's error in
that thread) aborts every per-worker resource made on it, so a PS recovery's probe of
it fails until `connect_timeout`. `internals.revive_orphaned_workers` recovers it as
TF recovers a worker. The mark is set here as TF leaves it."""

import pytest
import tensorflow as tf

import tf_asgd
from tf_asgd import internals

pytestmark = pytest.mark.usefixtures("hang_guard")  # conftest.py


def _probe_all(strategy):
    version = strategy.counters.version
    probe = tf.function(lambda: version.read_value() + 0, autograph=False)
    results = []
    for run in internals.on_every_worker(strategy.coordinator, probe):
        try:
            results.append(int(run.fetch()))
        except tf.errors.CancelledError as e:
            results.append(str(e))
    return results


def test_a_worker_marked_failed_with_an_idle_thread_runs_closures_again_once_revived():
    with tf_asgd.LocalCluster(2, 1) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=2)
        assert _probe_all(strategy) == [0, 0]
        worker = strategy.coordinator._cluster.workers[1]
        # What TF leaves after a reconnection that failed on a lost PS.
        worker._is_dead_with_error = tf.errors.UnavailableError(None, None, "ps:0 refused")
        aborted = _probe_all(strategy)
        assert aborted[0] == 0 and "aborted" in aborted[1], aborted

        assert internals.revive_orphaned_workers(strategy.coordinator) == [1]
        assert _probe_all(strategy) == [0, 0]
        assert internals.revive_orphaned_workers(strategy.coordinator) == []
