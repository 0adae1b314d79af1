"""TF_CONFIG parsing for the launcher: good and bad inputs, and the launcher's own check."""

import json
import os
import subprocess
import sys

import pytest

from tf_asgd.cluster.tf_config import tf_config_role

from helpers import ROOT

CLUSTER = {
    "chief": ["host0:2222"],
    "worker": ["host1:2222", "host2:2222"],
    "ps": ["host3:2222"],
}


def tf_config(cluster=CLUSTER, task_type="worker", index=0):
    return {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    }


def test_unset_or_empty_means_local():
    assert tf_config_role({}) is None
    assert tf_config_role({"TF_CONFIG": "  "}) is None


@pytest.mark.parametrize(
    "task_type,index", [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0), ("evaluator", 0)]
)
def test_good_roles(task_type, index):
    cluster, got_type, got_index = tf_config_role(tf_config(task_type=task_type, index=index))
    assert cluster == CLUSTER
    assert (got_type, got_index) == (task_type, index)


@pytest.mark.parametrize(
    "environ,quoted",
    [
        ({"TF_CONFIG": '{"cluster": {"worker": ["a:1"]'}, "not valid JSON"),
        (tf_config(task_type="master"), "'master'"),
        (tf_config(task_type="worker", index=2), "index 2 is out of range for job 'worker'"),
        (tf_config(task_type="ps", index=-1), "index -1"),
        (
            tf_config(cluster={"chief": ["a:1"], "worker": ["b:1"]}, task_type="chief"),
            "no 'ps' task",
        ),
        (tf_config(cluster={"chief": ["a:1"], "ps": ["b:1"]}, task_type="ps"), "no 'worker' task"),
        (
            tf_config(cluster={"worker": ["a:1"], "ps": ["b:1"]}, task_type="ps"),
            "exactly one 'chief'",
        ),
        (
            tf_config(cluster={**CLUSTER, "chief": ["a:1", "b:1"]}, task_type="ps"),
            "exactly one 'chief'",
        ),
        (
            tf_config(cluster={**CLUSTER, "trainer": ["a:1"]}, task_type="ps"),
            "unknown job 'trainer'",
        ),
        (tf_config(cluster={**CLUSTER, "ps": ["no-port"]}, task_type="ps"), "'host:port'"),
        (
            tf_config(cluster={**CLUSTER, "worker": ["host1:2222", "host1:2222"]}),
            "same address (worker:0 and worker:1 at host1:2222)",
        ),
        (
            tf_config(cluster={**CLUSTER, "ps": ["host0:2222"]}),
            "chief:0 and ps:0 at host0:2222",
        ),
    ],
)
def test_bad_tf_config_quotes_the_problem(environ, quoted):
    with pytest.raises(ValueError, match=None) as err:
        tf_config_role(environ)
    assert quoted in str(err.value)


def test_launcher_fails_at_once_on_malformed_tf_config(tmp_path):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", **tf_config(task_type="worker", index=5))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tf_asgd.launch",
            "--config=configs/default.py",
            f"--workdir={tmp_path}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "bad TF_CONFIG" in proc.stderr
    assert "index 5 is out of range for job 'worker'" in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing written, nothing started


@pytest.mark.parametrize("task_type", ["worker", "ps"])
def test_the_strategy_on_a_worker_or_ps_task_is_refused_at_once(monkeypatch, task_type):
    """The training script run on every task (the `MultiWorkerMirroredStrategy` habit):
    on a worker or ps task the strategy refuses at once, saying how to start a server
    there, instead of waiting `connect_timeout` for the cluster, itself included."""
    import time

    import tensorflow as tf

    import tf_asgd

    monkeypatch.setenv("TF_CONFIG", tf_config(task_type=task_type, index=0)["TF_CONFIG"])
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"This process is {task_type}:0 .*tf_asgd.launch"):
        tf_asgd.AsyncParameterServerStrategy(resolver, n_sync=10, connect_timeout=30)
    assert time.monotonic() - start < 5


def test_the_strategy_on_the_evaluator_is_refused_at_once(monkeypatch):
    """A user script run with the evaluator's TF_CONFIG would train as a second chief on
    the chief's address; it is refused at once, saying what an evaluator does instead."""
    import tensorflow as tf

    import tf_asgd

    cluster = dict(CLUSTER, evaluator=["localhost:1"])
    monkeypatch.setenv("TF_CONFIG", tf_config(cluster, task_type="evaluator")["TF_CONFIG"])
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    with pytest.raises(ValueError, match=r"This process is the cluster's evaluator .*checkpoints"):
        tf_asgd.AsyncParameterServerStrategy(resolver, n_sync=10, connect_timeout=30)


def test_the_evaluator_job_is_dropped_from_the_cluster_the_chief_connects_to():
    """The evaluator runs no TF server: TF's connection to a cluster listing it waited for
    it without end, so the chief connects to the cluster without it."""
    import tensorflow as tf

    from tf_asgd.cluster import tf_config as tf_config_module

    spec = tf.train.ClusterSpec(dict(CLUSTER, evaluator=["localhost:1"]))
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(spec, "", "chief", 0)
    dropped = tf_config_module.without_evaluator(resolver)
    assert dropped.cluster_spec().as_dict() == CLUSTER
    assert (dropped.task_type, dropped.task_id, dropped.rpc_layer) == ("chief", 0, "grpc")
    plain = tf.distribute.cluster_resolver.SimpleClusterResolver(tf.train.ClusterSpec(CLUSTER))
    assert tf_config_module.without_evaluator(plain) is plain


def test_an_index_written_as_a_string_is_read_as_tf_reads_it():
    text = json.dumps({"cluster": CLUSTER, "task": {"type": "worker", "index": "1"}})
    assert tf_config_role({"TF_CONFIG": text})[1:] == ("worker", 1)
