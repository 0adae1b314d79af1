"""A count of pushes on each PS task, to find a push cut between two PS tasks' writes.

A push's writes run on each PS that holds a piece of the model, after the ticket is taken
on the counters' PS. A worker that dies after the ticket can leave another PS's writes
undone (TF cancels that PS's part of the worker's function; measured in
tests/cluster/test_push_points_on_cluster.py), and the window's rerun then finds its id
applied and pushes nothing. The counters' PS adds 1 to `begun` before it takes a push's
ticket, and each PS adds 1 here after its own writes of the push, so at a quiet moment a
count falls short of `begun` exactly when a push was cut, wherever it was cut after it
began: after the ticket, between two PS tasks' writes (`ps_recovery` then goes back to
a snapshot).
"""

import tensorflow as tf

from tf_asgd.runtime.push import raw, shard_variables


class PushCommits:
    """One int64 counter per PS task that a model's pushes write to.

    Made once per model (`scheduling.WindowTrainer`), on the PS tasks of its variables
    and of the strategy's push counters (whose PS takes part in every push).

    Args:
        strategy: the `AsyncParameterServerStrategy`.
        variables: the model's central variables (Keras or TF, possibly sharded).

    Attributes:
        by_device: `{PS device: its counter}`.
        begun: on the counters' PS, the pushes begun (`begin`).
    """

    def __init__(self, strategy, variables):
        version = raw(strategy.counters.version)
        anchors = {version.device: version}
        for v in variables:
            for shard in shard_variables(raw(v)):
                anchors.setdefault(shard.device, shard)
        self.by_device = {}
        for device, anchor in sorted(anchors.items()):
            with strategy.scope(), strategy.extended.colocate_vars_with(anchor):
                self.by_device[device] = tf.Variable(
                    tf.constant(0, tf.int64), trainable=False, name="push_commits"
                )
            with strategy.scope(), strategy.extended.colocate_vars_with(version):
                self.begun = tf.Variable(
                    tf.constant(0, tf.int64), trainable=False, name="pushes_begun"
                )

    def begin(self, count):
        """The first write of a push, on the counters' PS before its ticket: `count` (1,
        or 0 for a push not made) added to `begun`. Returns the op."""
        return self.begun.assign_add(count, read_value=False)

    def counts(self):
        """`(pushes begun, {PS task ("ps:1"): pushes it has written})`, read eagerly."""
        # Eager reads, one per PS: a tf.function made per model would count as retraced
        # after a few models, and TF then warns about it in the user's console.
        begun, *values = [int(v.read_value()) for v in [self.begun, *self.by_device.values()]]
        return begun, {_task(d): n for d, n in zip(self.by_device, values)}

    def cut(self):
        """`(counts, the tasks behind)`: `{"begun": pushes begun, PS task: pushes it
        wrote}`, and the PS tasks that wrote fewer pushes than were begun; none while no
        push was cut. Read it where no push is in flight."""
        begun, counts = self.counts()
        behind = sorted(t for t, n in counts.items() if n < begun)
        return {"begun": begun, **counts}, behind


def _task(device):
    """ "/job:ps/replica:0/task:1/device:CPU:0" -> "ps:1"."""
    return "ps:" + device.split("/task:")[1].split("/")[0]
