"""A process that hosts TF server tasks: `python -m tf_asgd.cluster.task_server SPEC TASKS`.

`SPEC` is the cluster as JSON, `TASKS` a comma list like `ps:0,worker:1`.
The process prints `READY` once its servers listen, then serves until its
stdin closes (the parent's lifeline) or it gets SIGTERM. TF servers cannot
be stopped in-process, so ending this process is how they stop.
"""

import json
import os
import signal
import sys

from tf_asgd.cluster import local_cluster


def serve(cluster, tasks):
    """Starts TF servers for `tasks` ("job:index") in this process and returns them.

    The caller keeps the process alive.
    """
    tf = local_cluster.import_tensorflow("tf_asgd.cluster.task_server")

    # Tasks that share a process share its inter-op thread pool; a pool no
    # larger than the core count deadlocks when every thread blocks on a
    # Recv from a PS living in the same pool.
    config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=max(8, 4 * len(tasks)))
    servers = []
    for task in tasks:
        job, index = task.split(":")
        servers.append(
            tf.distribute.Server(
                tf.train.ClusterSpec(cluster),
                job_name=job,
                task_index=int(index),
                protocol="grpc",
                config=config,
                start=True,
            )
        )
    print(local_cluster.READY, flush=True)
    return servers


def _main(argv):
    # Exit when the parent goes away (stdin EOF) or is asked to (SIGTERM).
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    # Held, not used: the servers run while they are referenced.
    _servers = serve(json.loads(argv[1]), argv[2].split(","))
    sys.stdin.read()
    os._exit(0)  # the servers end with the process (TF cannot stop them)


if __name__ == "__main__":
    _main(sys.argv)
