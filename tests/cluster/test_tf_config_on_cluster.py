"""TF_CONFIG parsing for the launcher: good and bad inputs, and the launcher's own check."""

import json

from tf_asgd.cluster import local_cluster as cluster_lib

CLUSTER = {
    "chief": ["host0:2222"],
    "worker": ["host1:2222", "host2:2222"],
    "ps": ["host3:2222"],
}


def tf_config(cluster=CLUSTER, task_type="worker", index=0):
    return {
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})
    }


def test_stop_hooks_are_kept_only_for_clusters_this_process_serves(local_cluster):
    """A strategy registers its coordinator's stop with the `LocalCluster`
    it runs on; for a TF_CONFIG cluster, which never closes here, nothing is
    kept (it would stay for the life of the process)."""

    calls = []
    cluster_lib.before_stop(CLUSTER, lambda: calls.append("tf_config"))
    assert cluster_lib._tasks_key(CLUSTER) not in cluster_lib._BEFORE_STOP
    with local_cluster(1, 1, own=True, shared_process=True) as local:
        cluster_lib.before_stop(local.cluster_spec, lambda: calls.append("local"))
        assert calls == []
    assert calls == ["local"]
    assert cluster_lib._tasks_key(local.cluster_spec) not in cluster_lib._BEFORE_STOP
