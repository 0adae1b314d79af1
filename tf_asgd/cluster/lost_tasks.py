"""Which cluster task was lost, and what to tell the user.

When the chief loses contact with the cluster (`tf.errors.UnavailableError`),
`task_lost_error` probes every task's port and names those that refuse a
connection, with the checkpoint to `--resume` from.
"""

import socket
import time

from tf_asgd.errors import ClusterTaskLostError


def unreachable_tasks(cluster, timeout=2.0):
    """`["ps:0 (localhost:1234)", ...]`: tasks of `cluster` (a dict) whose port
    refuses a TCP connection (the chief's own entry is skipped)."""
    down = []
    for job, addresses in sorted(cluster.items()):
        if job in ("chief", "evaluator"):
            continue
        for i, address in enumerate(addresses):
            host, port = address.rsplit(":", 1)
            try:
                socket.create_connection((host, int(port)), timeout=timeout).close()
            except OSError:
                down.append(f"{job}:{i} ({address})")
    return down


LOST_TASK_PROBE_SECS = 5.0


def task_lost_error(error, cluster, manager, epoch_var):
    """A `ClusterTaskLostError` for `error` (a `tf.errors.UnavailableError`):
    which tasks of `cluster` are unreachable, and the checkpoint to resume from."""
    # A task killed a moment ago can still accept connections while the
    # kernel tears down its memory (its sockets close last): probe again
    # for a few seconds before blaming the link.
    deadline = time.monotonic() + LOST_TASK_PROBE_SECS
    while not (down := unreachable_tasks(cluster)) and time.monotonic() < deadline:
        time.sleep(0.5)
    latest = manager.latest_checkpoint
    where = (
        f"The newest checkpoint is {latest} (epoch {int(epoch_var.numpy())}); rerun "
        "with --resume to continue from it."
        if latest
        else "No checkpoint was written yet; rerun to start again."
    )
    what = (
        f"unreachable: {', '.join(down)}"
        if down
        else "every task still accepts connections, so the link failed"
    )
    return ClusterTaskLostError(
        f"Training stopped: lost contact with the cluster ({what}). The parameter "
        "servers hold the central variables, so training cannot go on without "
        f"one. {where} (TensorFlow said: {str(error).splitlines()[0][:300]})"
    )
