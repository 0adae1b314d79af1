"""The function one window runs on a worker, in named phases.

`WindowFunction.run` is traced once into the `tf.function` that
`scheduling.WindowTrainer.train_function` schedules on some worker per
window. Its phases, each a method:

1. `_shift_data_once`: before its first window, worker `i` skips `i` batches;
2. `_already_pushed`: a re-run of a window that already pushed is a replay;
3. `_pull`: the central variables, the version counter, the optimizer state;
4. `_local_steps`: `n_sync` steps on loop tensors (`_step` is one);
5. `_outgoing`: the update to push, through the push rule (GEM) if any;
6. `_push_skip_or_replay`: push it (`push.push_update`), or count a NaN/Inf
   update as skipped, or do nothing for a replay;
7. `_write_worker_state`: the worker's own optimizer and push-rule state;
8. `_pack_result`: one tensor for the chief (`records.WindowResultLayout`).

Order: inside one `tf.function` TF runs an op as soon as its inputs are
ready, whatever the source order: a ticket taken without a dependency on
the window's computation ran right after the pull. Every ordering that
matters is a data or control dependency made here: the version ticket
is taken under control dependencies on the whole update having reached the
PS (`push.push_update`); the step count and the window's id are written
under the ticket; the per-worker variables are written outside the push's
`tf.cond` (per-worker variables are captured at call time, which does not
reach into cond branches), under a control dependency on its outcome; the
result, with its timestamp, under control dependencies on all of those.
"""

import typing

import numpy as np
import tensorflow as tf
from keras import StatelessScope
from keras.utils import unpack_x_y_sample_weight

from tf_asgd import internals
from tf_asgd.push import push_update, raw, read

APPLIED_RING = 1 << 16  # window ids remembered on the PS (8 bytes each)


class _Pulled(typing.NamedTuple):
    """What a window's pull read: the state its local steps start from."""

    version: tf.Tensor  # the PS version counter at pull time
    weights: list  # the central variables (trainable, then non-trainable)
    optimizer_values: list  # the local optimizer's variables (shared from the PS, or the worker's own)


class _Outgoing(typing.NamedTuple):
    """What a window would push, and the worker state it would keep."""

    update: list  # one tensor per central variable (after the push rule, if any)
    worker_state: list  # new values of `WindowFunction.worker_state`
    rule_updates: list  # (per-worker variable, new value) of the push rule
    pi_stats: tf.Tensor  # [n_trainable, 3], or [0, 3] without a push rule


class WindowFunction:
    """One window's work on a worker, and the worker-side state it keeps.

    Creates, under the strategy's scope: the local optimizer (the compiled
    one, or the push rule's), its per-worker state, the push rule's
    per-worker state, the data-shift flag, and the ring of applied window
    ids on the PS.

    Args:
        trainer: the `scheduling.WindowTrainer` it runs for. Read from it:
            `model`, `strategy`, `variables`, `push_rule`, `layout`, and, when
            traced, `metric_init` (the metric values a window starts from).
    """

    def __init__(self, trainer):
        self._trainer = trainer
        model, strategy, push_rule = trainer.model, trainer.strategy, trainer.push_rule
        opt = model.optimizer
        with strategy.scope():
            self.local_optimizer = (
                push_rule.local_optimizer(model.trainable_variables) if push_rule else opt
            )
            lo = self.local_optimizer
            # Shared optimizer state: the step counter (the compiled optimizer's,
            # so that `model.optimizer.iterations` counts every step applied) and
            # the learning rate are read from the PS each window, so schedules
            # and callbacks such as ReduceLROnPlateau see the global values. The
            # rest (momentum, Adam's moments) is the worker's own, kept in
            # per-worker variables.
            self._shared = {id(lo.iterations): opt.iterations}
            lr = internals.learning_rate_variable(lo)
            if lr is not None:
                self._shared[id(lr)] = lr
            initial = [read(raw(v)) for v in lo.variables if id(v) not in self._shared]
            self.worker_state = [internals.per_worker_variable(v) for v in initial]
            # What `worker_state="reset"` restores at each pull: zeros for
            # the usual zero-initialised slots, else the initial values.
            self._initial_state = [
                None if not np.any(v.numpy()) else v.numpy() for v in initial
            ]
            if push_rule:
                push_rule.create_worker_state(model.trainable_variables)
            self.data_shifted = internals.per_worker_variable(False)
        with strategy.scope(), strategy.extended.colocate_vars_with(strategy.counters.version):
            # Slot `id % APPLIED_RING` holds `id + 1` once window `id` pushed.
            self.applied_windows = tf.Variable(
                tf.zeros([APPLIED_RING], tf.int64), trainable=False, name="applied_windows"
            )

    def run(self, iterator, num_steps, window_id):
        """One window on a worker (traced into the function the trainer schedules).

        Phases: skip this worker's first batches (once), check for a replay,
        pull, local steps, compute the outgoing update, push it (or skip a
        NaN/Inf one, or nothing for a replay), write the worker's state, pack
        the result.

        Args:
            iterator: the per-worker dataset iterator.
            num_steps: int32 scalar, the window's local steps (`n_sync`).
            window_id: int64 scalar, unique per window (a re-run keeps it).

        Returns:
            The packed result (`records.WindowResultLayout`).
        """
        worker = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int64)
        self._shift_data_once(iterator, worker)
        replayed, slot = self._already_pushed(window_id)
        num_steps = tf.where(replayed, tf.zeros_like(num_steps), num_steps)
        pulled = self._pull()
        weights, opt_values, metric_values = self._local_steps(iterator, num_steps, pulled)
        outgoing = self._outgoing(pulled, weights, opt_values)
        pushed, tau = self._push_skip_or_replay(outgoing, pulled, num_steps, window_id, slot, replayed)
        state_ops = self._write_worker_state(pushed, pulled, outgoing)
        with tf.control_dependencies([pushed] + state_ops):
            return self._pack_result(worker, pushed, replayed, tau, metric_values, outgoing.pi_stats)

    def _shift_data_once(self, iterator, worker):
        """Before its first window, worker `i` skips `i` batches (see
        `strategy._WindowDataset`): seeded workers must not train on the same
        batches. `data_shifted` is set by `_write_worker_state`."""
        shifted = self.data_shifted.read_value()
        for _ in tf.range(tf.where(shifted, tf.zeros_like(worker), worker)):
            next(iterator)

    def _already_pushed(self, window_id):
        """Whether an earlier attempt of this window (on a worker that died
        before returning) already pushed; a replay then runs nothing and
        pushes nothing. Returns `(replayed, slot)`: a bool scalar and the
        window's `[1]` index into the ring `applied_windows`."""
        slot = tf.reshape(window_id % APPLIED_RING, [1])
        replayed = tf.reduce_any(
            tf.equal(self.applied_windows.sparse_read(slot), window_id + 1)
        )
        return replayed, slot

    def _pull(self):
        """Pull: reads the PS version counter, the central variables and the
        local optimizer's state (the step counter and learning rate from the
        PS, the rest from this worker's own variables). Returns a `_Pulled`."""
        version = self._trainer.strategy.counters.version.read_value()
        weights = [tf.identity(read(raw(v))) for v in self._trainer.variables]
        reset = self._trainer.strategy.worker_state == "reset"
        opt_values, own = [], iter(zip(self.worker_state, self._initial_state))
        for v in self.local_optimizer.variables:
            shared = self._shared.get(id(v))
            if shared is not None:
                opt_values.append(raw(shared).read_value())
                continue
            var, initial = next(own)
            if not reset:
                opt_values.append(var.read_value())
            elif initial is None:
                opt_values.append(tf.zeros(var.shape, var.dtype))
            else:
                opt_values.append(tf.constant(initial))
        return _Pulled(version, weights, opt_values)

    def _local_steps(self, iterator, num_steps, pulled):
        """Local steps: `num_steps` steps of the local optimizer on the worker's
        own batches, with weights, optimizer state and metric state carried as
        loop tensors; nothing is written to any variable meanwhile. Returns
        `(weights, optimizer_values, metric_values)` after the last step."""
        metric_values = [tf.constant(m) for m in self._trainer.metric_init]
        weights, opt_values = list(pulled.weights), list(pulled.optimizer_values)
        for _ in tf.range(num_steps):
            weights, opt_values, metric_values = self._step(
                next(iterator), weights, opt_values, metric_values
            )
        return weights, opt_values, metric_values

    def _step(self, batch, weights, opt_values, metric_values):
        """One training step on loop tensors (Keras's `stateless_*` API)."""
        model, n_train = self._trainer.model, len(self._trainer.model.trainable_variables)
        x, y, sample_weight = unpack_x_y_sample_weight(batch)
        trainable, non_trainable = weights[:n_train], weights[n_train:]
        with tf.GradientTape() as tape:
            tape.watch(trainable)
            y_pred, non_trainable = model.stateless_call(
                trainable, non_trainable, x, training=True
            )
            loss, (_, _, metric_values) = model.stateless_compute_loss(
                trainable, non_trainable, metric_values, x=x, y=y,
                y_pred=y_pred, sample_weight=sample_weight, training=True,
            )
        grads = tape.gradient(loss, trainable)
        trainable, opt_values = internals.stateless_apply(
            self.local_optimizer, opt_values, grads, trainable
        )
        mapping = list(zip(model.metrics_variables, metric_values))
        with StatelessScope(state_mapping=mapping) as scope:
            internals.loss_tracker(model).update_state(
                loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0]
            )
            model.compute_metrics(x, y, y_pred, sample_weight)
        metric_values = [
            scope.get_current_value(v) if scope.get_current_value(v) is not None else m
            for v, m in zip(model.metrics_variables, metric_values)
        ]
        return list(trainable) + list(non_trainable), opt_values, metric_values

    def _outgoing(self, pulled, weights, opt_values):
        """The update to push (`weights - pulled`, the trainable part passed
        through the push rule, e.g. GEM's `pi * g`) and the worker state to
        keep if it is pushed. Returns an `_Outgoing`."""
        n_train = len(self._trainer.model.trainable_variables)
        update = [w - s for w, s in zip(weights, pulled.weights)]
        worker_state = self._own(opt_values)
        if self._trainer.push_rule:
            pushed_train, rule_updates, pi_stats = self._trainer.push_rule.transform(
                update[:n_train], pulled.weights[:n_train]
            )
            update = list(pushed_train) + update[n_train:]
        else:
            rule_updates, pi_stats = [], tf.zeros([0, 3])
        return _Outgoing(update, worker_state, rule_updates, pi_stats)

    def _own(self, opt_values):
        """The entries of `opt_values` kept in `worker_state` (not shared with the PS)."""
        return [o for v, o in zip(self.local_optimizer.variables, opt_values) if id(v) not in self._shared]

    def _push_skip_or_replay(self, outgoing, pulled, num_steps, window_id, slot, replayed):
        """Push, skip or replay.

        - push (a finite update, not a replay): `push.push_update` (the
          ticket is taken only once the whole update is on the PS), then,
          under the ticket, the step count and the window's id in
          `applied_windows`;
        - skip (the update holds NaN/Inf): count it in `dropped_nonfinite`;
        - replay: nothing.

        Returns `(pushed, tau)`: a bool scalar and the staleness (-1 when not
        pushed), both under control dependencies on the branch's writes.
        """
        counters = self._trainer.strategy.counters
        finite = tf.reduce_all(
            [tf.reduce_all(tf.math.is_finite(u)) for u in outgoing.update if u.dtype.is_floating]
        )

        def push():
            strategy = self._trainer.strategy
            ops, tau = push_update(
                self._trainer.variables, outgoing.update, pulled.version, counters,
                strategy.staleness, strategy.max_staleness, self._trainer.outer,
                self._trainer.outer_slots, strategy.num_workers,
            )
            # Like the variables, the step count and the window's id are
            # written only once the whole update has reached the PS.
            iterations = raw(self._trainer.model.optimizer.iterations)
            with tf.control_dependencies([tau]):
                ops.append(
                    iterations.assign_add(tf.cast(num_steps, iterations.dtype), read_value=False)
                )
            with tf.device(self.applied_windows.device), tf.control_dependencies([tau]):
                ops.append(tf.raw_ops.ResourceScatterUpdate(
                    resource=self.applied_windows.handle, indices=slot,
                    updates=tf.reshape(window_id + 1, [1]),
                ))
            with tf.control_dependencies(ops):
                return tf.constant(True), tf.identity(tau)

        not_pushed = tf.constant(-1, tf.int64)

        def skip():
            op = counters.dropped_nonfinite.assign_add(1, read_value=False)
            with tf.control_dependencies([op]):
                return tf.constant(False), tf.identity(not_pushed)

        def replay():
            return tf.constant(False), tf.identity(not_pushed)

        return tf.cond(replayed, replay, lambda: tf.cond(finite, push, skip))

    def _write_worker_state(self, pushed, pulled, outgoing):
        """Writes the worker's own state: the data-shift flag, the local
        optimizer's state and the push rule's state, the new values if the
        window pushed, else the old ones.

        Per-worker variables are captured at call time, which does not reach
        into cond branches: they are written here, outside the `tf.cond` of
        the push, under a control dependency on its outcome. Returns the
        write ops.
        """
        old_state = self._own(pulled.optimizer_values)
        state_ops = []
        with tf.control_dependencies([pushed]):
            state_ops.append(self.data_shifted.assign(True, read_value=False))
            for var, new, old in zip(self.worker_state, outgoing.worker_state, old_state):
                state_ops.append(var.assign(tf.where(pushed, new, old), read_value=False))
            for var, new in outgoing.rule_updates:
                state_ops.append(var.assign(tf.where(pushed, new, var.read_value()), read_value=False))
        return state_ops

    def _pack_result(self, worker, pushed, replayed, tau, metric_values, pi_stats):
        """The window's result as one tensor (`records.WindowResultLayout`);
        call under control dependencies on the push and the state writes, so
        that the timestamp is taken after them."""
        header = dict(
            worker=worker,
            pushed=tf.logical_or(pushed, replayed),  # the update is in the central variables, once
            replayed=replayed,
            finished_at=tf.timestamp(),  # under the control dependency: after the push
            staleness=tau,
        )
        deltas = [m - i for m, i in zip(metric_values, self._trainer.metric_init)]
        return self._trainer.layout.pack(header, deltas, pi_stats)
