"""Named points of a push where a test can hold it, to kill a task right there.

Off in production: with no point armed, `hold` adds no op to the trace. A test arms one
(`armed`) before the push is traced; the push's ops on that device then wait, spinning on
`tf.timestamp()`, for the armed seconds after the point is reached, for the pushes whose
ticket the test names. Meanwhile the test kills or stops a task, and checks what the push
left (tests/cluster/test_push_points_on_cluster.py).
"""

import contextlib

import tensorflow as tf

# Where a push can be held, on the counters' PS unless said: after its ticket and its id
# in the ring of applied ids, before its writes; after that PS's own writes, before
# another PS's writes (held there); after every PS's writes, before the worker hears.
POINTS = ("after_ticket", "between_ps_writes", "after_last_write")
_armed = {}  # point -> (seconds, ticket)


@contextlib.contextmanager
def armed(point, seconds, ticket):
    """Holds the push with version ticket `ticket` at `point` for `seconds`, in every push
    traced inside the block.

    Args:
        point: one of `POINTS`.
        seconds: how long the push waits there.
        ticket: the 0-based version ticket of the push to hold; the others pass. An int,
            or an int64 `tf.Variable` on a PS that each push reads (a test then picks the
            ticket while `fit` runs; -1 holds none).

    Example:

    ```python
    with fault_points.armed("between_ps_writes", 6.0, ticket=3):
        model.fit(...)  # the 4th push waits 6 s after the ticket, before ps:1's writes
    ```
    """
    if point not in POINTS:
        raise ValueError(f"Unknown fault point {point!r}; the points are {POINTS}.")
    _armed[point] = (float(seconds), ticket if isinstance(ticket, tf.Variable) else int(ticket))
    try:
        yield
    finally:
        _armed.pop(point, None)


def hold(point, ticket, after):
    """Tensors for the push's later ops to depend on: none when `point` is not armed, else
    one that exists `seconds` after `after` (tensors or ops) for the armed ticket, at once
    for any other. Build on the device that must wait."""
    if point not in _armed:
        return []
    seconds, which = _armed[point]
    with tf.control_dependencies(after):
        start = tf.timestamp()
        which = tf.cast(which, tf.int64)  # (a variable is read as the push gets here)
    wait = tf.where(tf.equal(tf.cast(ticket, tf.int64), which), seconds, 0.0)
    wait = tf.cast(wait, tf.float64)
    (done,) = tf.while_loop(lambda t: t - start < wait, lambda t: [tf.timestamp()], [start])
    return [done]
