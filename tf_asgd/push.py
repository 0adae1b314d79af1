"""The PS side of a window: reading central variables and applying a push.

`push_update` is the one place where a window's update reaches the central
variables: it is staged on every PS first, then the version ticket is taken
and `update_rules.staleness_scale(tau) * update` is added where each
variable (or shard) lives.
"""

import numpy as np
import tensorflow as tf
import tensorflow.experimental.numpy as tnp
from keras import Variable

from tf_asgd import internals, outer, update_rules


def raw(v):
    """The `tf.Variable` behind a Keras variable."""
    return v.value if isinstance(v, Variable) else v


def nbytes(variables):
    """Bytes of `variables` (Keras or TF variables), as one pull reads them."""
    return int(sum(np.prod(v.shape) * v.dtype.size for v in map(raw, variables)))


def read(raw_variable):
    """The value of a (possibly sharded) PS variable."""
    if internals.is_sharded(raw_variable):
        return tf.concat([s.read_value() for s in raw_variable.variables], axis=0)
    return raw_variable.read_value()


def shards(raw_variable, value):
    """`(variable, slice of value)` per PS shard of a (possibly sharded) variable."""
    if internals.is_sharded(raw_variable):
        sizes = [s.shape[0] for s in raw_variable.variables]
        return list(zip(raw_variable.variables, tf.split(value, sizes, axis=0)))
    return [(raw_variable, value)]


def shard_variables(raw_variable):
    """The PS variables that hold a (possibly sharded) variable."""
    if internals.is_sharded(raw_variable):
        return list(raw_variable.variables)
    return [raw_variable]


def device_of(raw_variable):
    """The device of a (possibly sharded) variable's first piece."""
    if internals.is_sharded(raw_variable):
        return raw_variable.variables[0].device
    return raw_variable.device


def push_update(variables, updates, pulled_version, counters, rule, max_staleness,
                outer_optimizer=None, slots=None, num_workers=1):
    """The PS side of a push; call inside a closure running on a worker.

    First every piece of the update is copied to the PS that holds its
    variable (or shard); only once all have arrived is the version ticket
    taken (so staleness is measured at push time) and anything written. A
    worker that dies while its update is in transit therefore leaves the PS
    untouched, not half-updated. Then `scale(tau)` is computed on the PS that
    holds the counter and each PS applies the outer optimizer to the
    pseudo-gradient `-scale * update` of its variables (`outer.apply`; by
    default it adds `scale * update`). Pushes with `tau > max_staleness` are
    counted as dropped (their scale is 0).

    Args:
        variables: the central variables (Keras or TF, possibly sharded).
        updates: one tensor per variable, the window's update.
        pulled_version: int64 scalar, the version counter read at pull time.
        counters: the strategy's `counters.PushCounters`.
        rule: the staleness rule (`update_rules.STALENESS_RULES`).
        max_staleness: drop pushes staler than this; None keeps all.
        outer_optimizer: `update_rules.OuterSGD` or `DelayedNesterov`;
            default `OuterSGD()`.
        slots: per variable, per shard, the outer state (`outer.create_slots`),
            `{}` for none; default none anywhere.
        num_workers: the cluster's worker count (`DelayedNesterov`'s default delay).

    Returns:
        `(ops, tau)`: the write ops, whose control dependencies order the
        push, and the push's staleness (int64 scalar).
    """
    outer_optimizer = outer_optimizer or update_rules.OuterSGD()
    arrived = []  # (PS variable, its piece of the update, now on that PS, its outer slots)
    for i, (v, u) in enumerate(zip(variables, updates)):
        for j, (shard, piece) in enumerate(shards(raw(v), u)):
            with tf.device(shard.device):
                arrived.append((shard, tf.identity(piece), slots[i][j] if slots else {}))
    with tf.control_dependencies([piece for _, piece, _ in arrived]):
        tau = counters.take_ticket(pulled_version)
    with tf.device(raw(counters.version).device):
        scale = update_rules.staleness_scale(tau, rule, max_staleness, xp=tnp)
        dropped = tf.cast(update_rules.is_dropped(tau, max_staleness), tf.int64)
        ticket = pulled_version + tau
    ops = [counters.dropped_stale.assign_add(dropped, read_value=False)]
    for shard, piece, shard_slots in arrived:
        # Under the ticket even where the scale is a constant ("none").
        with tf.device(shard.device), tf.control_dependencies([tau]):
            if piece.dtype.is_floating:
                ops.extend(outer.apply(outer_optimizer, shard, piece, shard_slots, scale,
                                       ticket, num_workers))
            else:  # integer state (RNG seeds) advances unscaled
                ops.append(shard.assign_add(piece, read_value=False))
    return ops, tau
