"""The outer optimizer on the PS: TF ops that compute `staleness.ps_push`.

A push's pseudo-gradient is `g = -scale(tau) * update`. Each piece of it is
applied on the PS that holds its variable (or shard), next to the outer
optimizer's state for that shard, under the push's version ticket.

Pushes from several workers reach a PS concurrently, so every write here is
either an add (adds commute) or TF's locked `ResourceApplyKerasMomentum`
(a read-modify-write of the velocity under the variable's lock).
"""

import tensorflow as tf

from tf_asgd.rules import outer_optimizers

NOISE_SUMS = ("noise_push_sq", "noise_round_sq")  # scalar slots: `noise_scale.from_sums`


def create_slots(opt, shard, noise_sums=False):
    """The outer state of one PS variable (or shard): `{slot name: tf.Variable}`.

    Call under the strategy's scope; the slots are colocated with `shard`.

    Args:
        opt: `outer_optimizers.OuterSGD` or `outer_optimizers.DelayedNesterov`.
        shard: the PS variable (or shard of one).
        noise_sums: synchronous rounds, with a `DelayedNesterov`: the chief takes each
            round's momentum step (`close_round`), and two float64 scalars
            (`NOISE_SUMS`) sum every push's squared norm on this shard and every
            round's. The gradient noise scale is read from them
            (`noise_scale.from_sums`).
    """
    strategy = tf.distribute.get_strategy()
    slots = {}
    prefix = shard.name.split(":")[0]
    with strategy.extended.colocate_vars_with(shard):
        for name in opt.slots:
            slots[name] = tf.Variable(
                tf.zeros(shard.shape, shard.dtype), trainable=False, name=f"{prefix}/outer_{name}"
            )
        if noise_sums and isinstance(opt, outer_optimizers.DelayedNesterov):
            for name in NOISE_SUMS:
                slots[name] = tf.Variable(
                    tf.zeros([], tf.float64), trainable=False, name=f"{prefix}/{name}"
                )
    return slots


def effective_learning_rate(opt, num_workers, ticket):
    """The factor the push with version ticket `ticket` is applied with,
    momentum aside (a tensor while `OuterSGD` warms up)."""
    if isinstance(opt, outer_optimizers.DelayedNesterov):
        return opt.learning_rate / (opt.delay or num_workers)
    return outer_optimizers.outer_learning_rate(opt, ticket, xp=tf.experimental.numpy)


def apply_moving_average(shard, piece, scale, momentum, steps):
    """The op that applies a push of a moving average (`piece`: the window's
    `outer_optimizers.moving_average_sent`) where `shard` stands now:
    `shard + scale * (piece - (1 - m^k) shard)` (`outer_optimizers.moving_average_push`).

    It is one locked op, TF's proximal gradient step: with `alpha = 1`, `l1 = 0` it sets
    `var = (var - delta) / (1 + l2)`, which is the push for `l2 = g / (1 - g)` and
    `delta = -scale * piece / (1 - g)`, where `g = scale * (1 - m^k)` (below 1): a
    read-modify-write under the variable's lock, so concurrent pushes lose nothing.
    """
    dtype = shard.dtype
    moved = 1.0 - tf.pow(tf.constant(momentum, tf.float64), tf.cast(steps, tf.float64))
    g = tf.minimum(tf.cast(scale, tf.float64) * moved, 1.0 - 1e-6)
    return tf.raw_ops.ResourceApplyProximalGradientDescent(
        var=shard.handle,
        alpha=tf.constant(1.0, dtype),
        l1=tf.constant(0.0, dtype),
        l2=tf.cast(g / (1.0 - g), dtype),
        delta=-tf.cast(tf.cast(scale, tf.float64) / (1.0 - g), dtype) * piece,
        use_locking=True,
    )


def apply(opt, shard, piece, slots, scale, ticket, num_workers):
    """Ops that apply `opt` to pseudo-gradient `-scale * piece` on `shard`.

    Args:
        opt: `outer_optimizers.OuterSGD` or `outer_optimizers.DelayedNesterov`.
        shard: the PS variable (or shard of one).
        piece: this shard's part of the worker's update, already on the PS.
        slots: `create_slots(opt, shard)`, or `{}` for variables that get no
            outer state (non-trainable ones: plain add at the outer rate).
        scale: the push's staleness scale (a scalar tensor).
        ticket: the push's 0-based version ticket (int64 scalar tensor).
        num_workers: the cluster's worker count (`DelayedNesterov`'s default delay).

    Returns:
        A list of ops.
    """
    dtype = piece.dtype
    g = -tf.cast(scale, dtype) * piece
    lr = tf.cast(effective_learning_rate(opt, num_workers, ticket), dtype)
    if not slots:
        return [shard.assign_add(-lr * g, read_value=False)]
    mu = tf.constant(opt.momentum, dtype)
    velocity = slots["velocity"]
    if isinstance(opt, outer_optimizers.OuterSGD):
        # velocity = mu * velocity - lr * g; shard += velocity
        # (Nesterov: shard += mu * velocity - lr * g), atomically.
        return [
            tf.raw_ops.ResourceApplyKerasMomentum(
                var=shard.handle,
                accum=velocity.handle,
                lr=lr,
                grad=g,
                momentum=mu,
                use_locking=True,
                use_nesterov=opt.nesterov,
            )
        ]
    buffer = slots["buffer"]
    if NOISE_SUMS[0] in slots:  # synchronous: `close_round` takes the momentum step
        push_sq = tf.reduce_sum(tf.cast(g, tf.float64) ** 2)
        return [
            buffer.assign_add(g, read_value=False),
            shard.assign_add(-lr * g, read_value=False),
            slots[NOISE_SUMS[0]].assign_add(push_sq, read_value=False),
        ]
    # Delayed Nesterov, written without branches: `due` is 1 for the pushes
    # whose ticket closes a group of `delay`, else 0.
    delay = opt.delay or num_workers
    due = tf.cast(tf.equal((ticket + 1) % delay, 0), dtype)
    total = buffer.assign_add(g, read_value=True)
    taken = due * total
    # Subtracting what was read keeps any concurrent push's add for the next group.
    take = buffer.assign_sub(taken, read_value=False)
    # The group's momentum step, velocity = mu * velocity - lr * taken and
    # shard += mu * velocity, in one op under both variables' locks: two pushes that
    # close groups at once each step on the other's velocity (a read, then an add of
    # what was computed from it, would lose one). A push that closes none steps by
    # nothing (momentum 1, gradient 0, rate 0).
    with tf.control_dependencies([take]):
        close = tf.raw_ops.ResourceApplyMomentum(
            var=shard.handle,
            accum=velocity.handle,
            lr=-due * mu,
            grad=-due * lr * taken,
            momentum=due * mu + (1.0 - due),
            use_locking=True,
            use_nesterov=False,
        )
    return [take, close, shard.assign_add(-lr * g, read_value=False)]


def close_round(opt, shard, slots, num_workers):
    """Ops of a synchronous round's momentum step on `shard`, once every push of the
    round is applied (the chief runs them at the round's barrier): the step the push
    whose ticket closes the group takes under `apply`, on the whole round's buffer.

    Taken by the chief, not by the round's last ticket: pushes of one round reach
    the PS concurrently, and the last ticket's push may add to the buffer before an
    earlier ticket's does, which would leave that window out of the round's step.

    Args:
        opt: the `outer_optimizers.DelayedNesterov`.
        shard: the PS variable (or shard of one).
        slots: its `create_slots(opt, shard, noise_sums=True)`.
        num_workers: the cluster's worker count (the default delay).

    Returns:
        A list of ops.
    """
    dtype = shard.dtype
    lr = tf.cast(effective_learning_rate(opt, num_workers, 0), dtype)
    mu = tf.constant(opt.momentum, dtype)
    buffer, velocity = slots["buffer"], slots["velocity"]
    taken = buffer.read_value()
    with tf.control_dependencies([taken]):
        new = mu * velocity.read_value() - lr * taken
    with tf.control_dependencies([new]):
        return [
            buffer.assign_sub(taken, read_value=False),
            velocity.assign(new, read_value=False),
            shard.assign_add(mu * new, read_value=False),
            slots[NOISE_SUMS[1]].assign_add(
                tf.reduce_sum(tf.cast(taken, tf.float64) ** 2), read_value=False
            ),
        ]
