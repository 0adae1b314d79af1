"""Which cluster task was lost, and what to tell the user.

When the chief loses contact with the cluster (`tf.errors.UnavailableError`),
`task_lost_error` probes every task's port and names those that refuse a
connection, with the checkpoint to `--resume` from. `ps_lost_error` does the same
for a parameter server lost during `fit` or `evaluate` in any script, restarted
or not.
"""

import re
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
        f"one. {where} (TensorFlow said: {first_line(error)})"
    )


# What TF says when an op meets a restarted task (a new incarnation on the old address).
RESTARTED_SIGNS = (
    "was probably restarted",
    "Perhaps the worker was restarted",
    "some remote workers have been restarted",
    "Unable to find the relevant tensor remote_handle",
)
REFUSES = "which refuses connections"  # in `lost_ps`'s entry for a PS that is down
_PS_DEVICE = re.compile(r"/job:ps/replica:\d+/task:(\d+)")


def lost_ps(error, cluster):
    """The PS tasks `error` shows lost, `["ps:0 (localhost:1234, ...)", ...]`; empty if none.

    An `UnavailableError` or `AbortedError` that names a PS device, or any of these and
    an `InvalidArgumentError` that says a task was restarted, is a PS's loss when a PS
    of `cluster` (a dict) refuses connections or the error names one. A restarted PS
    answers again but has lost its variables.
    """
    import tensorflow as tf

    kinds = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.InvalidArgumentError)
    if not isinstance(error, kinds) or not cluster.get("ps"):
        return []
    text = str(error)
    named = sorted({int(i) for i in _PS_DEVICE.findall(text)})
    restarted = any(sign in text for sign in RESTARTED_SIGNS)
    if not restarted and (not named or isinstance(error, tf.errors.InvalidArgumentError)):
        return []  # an op's own bad argument on a PS is not the PS's loss
    down = {d.split(" ")[0] for d in unreachable_tasks({"ps": cluster["ps"]})}
    lost = []
    for i, address in enumerate(cluster["ps"]):
        task = f"ps:{i}"
        if task in down:
            lost.append(f"{task} ({address}, {REFUSES})")
        elif i in named:
            lost.append(f"{task} ({address}, {'restarted' if restarted else 'lost'})")
    if restarted and not lost:  # TF did not say which one
        lost.append(f"one of {', '.join(f'ps:{i}' for i in range(len(cluster['ps'])))} (restarted)")
    return lost


def ps_lost_error(error, cluster):
    """A `ClusterTaskLostError` for a PS lost during `fit` or `evaluate`, or None.

    Args:
        error: the error `fit` or `evaluate` raised.
        cluster: the cluster spec, a dict.

    Returns:
        The error to raise from `error` (None: not a PS's loss).
    """
    lost = lost_ps(error, cluster)
    if not lost:
        return None
    return ClusterTaskLostError(
        f"Training stopped: lost parameter server {', '.join(lost)}. The parameter servers "
        "hold the central variables, and a PS that comes back has lost them. It was not "
        "recovered in the run (that needs asynchronous `fit`, a snapshot, which "
        "`snapshot_every=None` turns off, and the PS back on its address within "
        "`connect_timeout`). Restore the model from a checkpoint on a new "
        "strategy (keras.callbacks.BackupAndRestore, or tf_asgd.launch's --resume, which "
        "does this; docs/faults.md). "
        f"(TensorFlow said: {first_line(error)})"
    )


_STATUS_LINE = re.compile(r"\b(?:UNAVAILABLE|ABORTED|INVALID_ARGUMENT|CANCELLED):\s*(.+)")


def first_line(error):
    """What a TF error's message says first, at most 300 characters: its first status
    line (`UNAVAILABLE: Socket closed`), else its first line."""
    text = str(error)
    found = _STATUS_LINE.search(text)
    line = found.group(0) if found else (text.strip().splitlines() or [""])[0]
    return line.strip()[:300]
