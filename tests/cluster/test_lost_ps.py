"""A parameter server lost during `fit` or `evaluate` in a user's own script: the error
names it, as `ClusterTaskLostError`, and says how to go on; nothing hangs."""

import time

import keras
import numpy as np
import pytest

import tf_asgd
from tf_asgd.cluster import lost_tasks

from helpers import KillTask, dense_digits_model
from launching import alive

pytestmark = pytest.mark.usefixtures("hang_guard")


def test_a_ps_killed_mid_fit_and_restarted_is_named_by_fit_and_evaluate(local_cluster, digits):
    """2 workers, 2 PS and a variable split over both, no snapshots (`snapshot_every=None`,
    so no recovery); ps:0 SIGKILLed mid-`fit` and restarted 2 s later: `fit` raises
    `ClusterTaskLostError` naming ps:0 and its address within 30 s of the kill, from TF's
    error; `evaluate` once it is back says it was restarted; the cluster closes with no
    task left."""
    import tensorflow as tf

    (x, y), (xt, yt) = digits
    with local_cluster(2, 2, own=True, shared_process=False) as cluster:
        pids = cluster.pids()
        partitioner = tf.distribute.experimental.partitioners.MaxSizePartitioner(
            max_shard_bytes=1024
        )
        strategy = tf_asgd.AsyncParameterServerStrategy(
            cluster.resolver,
            n_sync=5,
            variable_partitioner=partitioner,
            per_worker_dataset_fn=tf_asgd.data.emulated_device_time(20),
            snapshot_every=None,
        )
        model = dense_digits_model(strategy, keras.optimizers.SGD(0.05))
        assert any(len(getattr(v.value, "variables", [])) > 1 for v in model.weights)  # sharded
        kill = KillTask(cluster)
        with pytest.raises(tf_asgd.ClusterTaskLostError) as info:
            model.fit(
                x, y, batch_size=32, epochs=50, steps_per_epoch=40, callbacks=[kill], verbose=0
            )
        raised = time.monotonic()
        address = cluster.cluster_spec["ps"][0]
        message = str(info.value)
        assert f"lost parameter server ps:0 ({address}" in message, message
        assert "ps:1" not in message and "--resume" in message
        assert isinstance(info.value.__cause__, tf.errors.OpError)
        assert raised - kill.events["killed"] < 30
        kill.thread.join(60)
        assert "restarted" in kill.events, kill.events
        # It answers again (the chief's channel may first repeat its last refusal while
        # gRPC backs off: at most a few seconds).
        deadline = time.monotonic() + 20
        while True:
            with pytest.raises(tf_asgd.ClusterTaskLostError) as again:
                model.evaluate(xt, yt, verbose=0)
            if "restarted" in str(again.value) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        assert f"ps:0 ({address}, restarted)" in str(again.value)
        assert "ps:1" not in str(again.value)
    assert not [p for p in pids.values() if alive(p)]


def test_errors_that_are_not_a_ps_loss_are_left_alone():
    import tensorflow as tf

    cluster = {"ps": ["localhost:1"], "worker": ["localhost:2"]}
    worker = tf.errors.UnavailableError(None, None, "/job:worker/replica:0/task:0: Socket closed")
    assert lost_tasks.ps_lost_error(worker, cluster) is None
    assert lost_tasks.ps_lost_error(ValueError("/job:ps/replica:0/task:0"), cluster) is None
    bad_argument = tf.errors.InvalidArgumentError(
        None, None, "Incompatible shapes: [3] vs. [4] on /job:ps/replica:0/task:0/device:CPU:0"
    )
    assert lost_tasks.ps_lost_error(bad_argument, cluster) is None
    stale_handle = tf.errors.InvalidArgumentError(
        None, None, "... or some remote workers have been restarted. [Op:AssignVariableOp]"
    )
    assert "ps:0" in str(lost_tasks.ps_lost_error(stale_handle, cluster))
    restarted = tf.errors.AbortedError(
        None, None, "Unable to find a context_id (1). Perhaps the worker was restarted, or ..."
    )
    error = lost_tasks.ps_lost_error(restarted, cluster)
    assert "ps:0 (localhost:1, which refuses connections)" in str(error)
    assert "TensorFlow said: Unable to find a context_id" in str(error)
    assert np.all([isinstance(error, RuntimeError)])
