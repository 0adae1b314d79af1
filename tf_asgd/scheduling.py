"""Window scheduling: one `ClusterCoordinator` closure per `n_sync` window.

A window is GPU A-SGD's unit of work (Paine et al. 2013). On one worker it:

1. pulls the central variables and the version counter from the PS,
2. runs `n_sync` local steps on the worker's own batches, carrying the
   weights, optimizer state and metric state as loop tensors (the model's
   `stateless_call`; nothing is written to the PS meanwhile),
3. pushes the accumulated update `local_end - local_start` once: it takes a
   version ticket (staleness `tau` = tickets issued since the pull) and the
   PS adds `scale(tau) * update` (`update_rules.staleness_scale`).

Ordering matters because TF runs an op as soon as its inputs are ready: the
ticket is taken under a control dependency on the computed update, and the
worker-local state is written from values that depend on it.

Exactly once: when a worker dies, TF's `ClusterCoordinator` puts its
in-flight closure back and runs it again on a live worker. If the dead worker
had already pushed (it died between its push and returning the result), a
plain re-run would push that window a second time. Each window therefore
carries an id from the chief; a push records it in a ring of applied ids on
the PS, and an attempt whose id is already recorded runs no steps and pushes
nothing (`WindowRecord.replayed`).
"""

import time
import typing

import numpy as np
import tensorflow as tf
import tensorflow.experimental.numpy as tnp
from keras import StatelessScope, Variable
from keras.utils import unpack_x_y_sample_weight
from tensorflow.python.distribute.sharded_variable import ShardedVariable

from tf_asgd import keras_hook, update_rules


def _raw(v):
    """The `tf.Variable` behind a Keras variable."""
    return v.value if isinstance(v, Variable) else v


def _nbytes(variables):
    return int(sum(np.prod(v.shape) * v.dtype.size for v in map(_raw, variables)))


class WindowRecord(typing.NamedTuple):
    """What the chief learns of each finished window."""

    worker: int  # index of the worker that ran it
    pushed: bool  # False: its update held NaN/Inf and was not pushed
    staleness: int  # tau of its push (pushes committed since its pull); -1 if not pushed
    loss: float  # mean training loss over the window's steps
    seen_at: float  # time.perf_counter() on the chief when it saw the window done
    finished_at: float  # time.time() on the worker once its push was applied
    state: tuple  # the window's own metric states (deltas), see WindowTrainer.window_results
    pi: typing.Optional[np.ndarray]  # GEM: [n_trainable, 3] pi mean, frac at 0, frac at pi_max
    # True: a re-run (after a worker died) of a window whose earlier attempt
    # had already pushed; this attempt ran no steps and pushed nothing.
    replayed: bool = False


MAX_IN_FLIGHT_PER_WORKER = 2  # windows scheduled but unfinished, per worker
APPLIED_RING = 1 << 16  # window ids remembered on the PS (8 bytes each)


def push_update(variables, updates, pulled_version, counters, rule, max_staleness):
    """The PS side of a push; call inside a closure running on a worker.

    First every piece of the update is copied to the PS that holds its
    variable (or shard); only once all have arrived is the version ticket
    taken (so staleness is measured at push time) and anything written. A
    worker that dies while its update is in transit therefore leaves the PS
    untouched, not half-updated. Then `scale(tau)` is computed on the PS that
    holds the counter and each PS adds `scale * update` to its variables.
    Pushes with `tau > max_staleness` are counted as dropped (their scale is
    0). Returns `(ops, tau)`: the ops' control dependencies order the push.
    """
    arrived = []  # (PS variable, its piece of the update, now on that PS)
    for v, u in zip(variables, updates):
        for shard, piece in _shards(_raw(v), u):
            with tf.device(shard.device):
                arrived.append((shard, tf.identity(piece)))
    with tf.control_dependencies([piece for _, piece in arrived]):
        tau = counters.take_ticket(pulled_version)
    with tf.device(_raw(counters.version).device):
        scale = update_rules.staleness_scale(tau, rule, max_staleness, xp=tnp)
        dropped = tf.cast(update_rules.is_dropped(tau, max_staleness), tf.int64)
    ops = [counters.dropped_stale.assign_add(dropped, read_value=False)]
    for shard, piece in arrived:
        # Under the ticket even where the scale is a constant ("none").
        with tf.device(shard.device), tf.control_dependencies([tau]):
            if piece.dtype.is_floating:
                piece = tf.cast(scale, piece.dtype) * piece
            # else: integer state (RNG seeds) advances unscaled
            ops.append(shard.assign_add(piece, read_value=False))
    return ops, tau


def _read(raw):
    """The value of a (possibly sharded) PS variable."""
    if isinstance(raw, ShardedVariable):
        return tf.concat([s.read_value() for s in raw.variables], axis=0)
    return raw.read_value()


def _shards(raw, value):
    """`(variable, slice of value)` per PS shard of a (possibly sharded) variable."""
    if isinstance(raw, ShardedVariable):
        sizes = [s.shape[0] for s in raw.variables]
        return list(zip(raw.variables, tf.split(value, sizes, axis=0)))
    return [(raw, value)]


class WindowTrainer:
    """Trains one Keras model with window closures on the workers.

    Built by the Keras hook on the first `fit` of a model whose strategy is an
    `AsyncParameterServerStrategy`; users do not create it.
    """

    def __init__(self, model, strategy):
        self.model, self.strategy = model, strategy
        self.optimizer = model.optimizer  # a recompiled model gets a new trainer
        self.coordinator = strategy.coordinator
        opt = model.optimizer
        self.push_rule = getattr(opt, "asgd_push_rule", None)
        self.variables = list(model.trainable_variables) + list(
            model.non_trainable_variables
        )
        for v in self.variables:
            raw = _raw(v)
            device = (raw.variables[0] if isinstance(raw, ShardedVariable) else raw).device
            if "/job:ps" not in device:
                raise ValueError(
                    f"Variable {v.path!r} lives on {device or 'the chief'}, "
                    "not on a parameter server: the model was built outside "
                    "`AsyncParameterServerStrategy.scope()`. Create and compile "
                    "the model inside `with strategy.scope():`."
                )
        with strategy.scope():
            self.local_optimizer = (
                self.push_rule.local_optimizer(model.trainable_variables)
                if self.push_rule
                else opt
            )
            lo = self.local_optimizer
            # Shared optimizer state: the step counter (the compiled optimizer's,
            # so that `model.optimizer.iterations` counts every step applied) and
            # the learning rate are read from the PS each window, so schedules
            # and callbacks such as ReduceLROnPlateau see the global values. The
            # rest (momentum, Adam's moments) is the worker's own, kept in
            # per-worker variables.
            self._shared = {id(lo.iterations): opt.iterations}
            if isinstance(getattr(lo, "_learning_rate", None), Variable):
                self._shared[id(lo._learning_rate)] = lo._learning_rate
            self.worker_state = [
                tf.Variable(_read(_raw(v)), per_worker_variable=True, trainable=False)
                for v in lo.variables
                if id(v) not in self._shared
            ]
            if self.push_rule:
                self.push_rule.create_worker_state(model.trainable_variables)
            self.data_shifted = tf.Variable(False, per_worker_variable=True, trainable=False)
        self.window_log = []  # a WindowRecord per finished window, in order seen
        self._ticketed = 0  # windows of window_log that took a version ticket
        self._metric_init = [np.asarray(v.numpy()) for v in model.metrics_variables]
        self._metric_sum = None
        self._epoch_windows = []
        self._pending = []
        self._next_window_id = 0
        self._max_in_flight = MAX_IN_FLIGHT_PER_WORKER * strategy.extended._num_workers
        self._logs, self._logs_at = None, 0.0
        with strategy.scope(), strategy.extended.colocate_vars_with(strategy.counters.version):
            # Slot `id % APPLIED_RING` holds `id + 1` once window `id` pushed.
            self.applied_windows = tf.Variable(
                tf.zeros([APPLIED_RING], tf.int64), trainable=False, name="applied_windows"
            )
        ids = [id(v) for v in model.metrics_variables]
        self._loss_index = [ids.index(id(v)) for v in model._loss_tracker.variables]
        self.bytes_per_pull = _nbytes(self.variables)
        self.bytes_per_push = self.bytes_per_pull
        self._window = tf.function(self._window_fn)

    # ---- chief side -------------------------------------------------------

    def train_function(self, iterator):
        """Keras's `train_function`: schedules one window.

        It returns at once while fewer than `MAX_IN_FLIGHT_PER_WORKER` windows
        per worker are unfinished, else once the oldest one finishes: enough
        queued to keep every worker busy, few enough that the progress bar
        follows the training and a stop waits for seconds, not an epoch.
        """
        window_id = tf.constant(self._next_window_id, tf.int64)
        self._next_window_id += 1
        rv = self.coordinator.schedule(
            self._window,
            args=(iterator, tf.constant(self.strategy.n_sync, tf.int32), window_id),
        )
        self._pending.append(rv)
        self._drain(block=True, keep=self._max_in_flight)
        # Progress for callbacks, refreshed a few times a second at most: the
        # chief's time per window bounds throughput at small n_sync.
        now = time.perf_counter()
        if self._logs is None or now - self._logs_at > 0.25:
            self._drain(block=False)
            self._logs, self._logs_at = self.logs(), now
        return self._logs

    def _drain(self, block, keep=0):
        """Records finished windows in the order they finish; with `block`,
        waits until at most `keep` are unfinished.

        Any finished window frees a slot, not only the oldest: waiting for the
        oldest would hold every fast worker behind a straggler's window.
        """
        while True:
            ready = [rv for rv in self._pending if keras_hook.remote_value_ready(rv)]
            for rv in ready:
                self._pending.remove(rv)
                self._record(np.asarray(rv.fetch()))
            if not block or len(self._pending) <= keep:
                return
            keras_hook.wait_briefly(self._pending[0])

    def _record(self, packed):
        worker, pushed, replayed, finished_at, staleness = packed[:5]
        values, at = [], 5
        for init in self._metric_init:
            values.append(packed[at:at + init.size].reshape(init.shape).astype(init.dtype))
            at += init.size
        total, count = (values[i] for i in self._loss_index)
        record = WindowRecord(
            worker=int(worker),
            pushed=bool(pushed),
            staleness=int(staleness),
            loss=float(total / count) if count else float("nan"),
            seen_at=time.perf_counter(),
            finished_at=float(finished_at),
            state=tuple(values),
            pi=packed[at:].reshape(-1, 3) if self.push_rule else None,
            replayed=bool(replayed),
        )
        self.window_log.append(record)
        self._ticketed += record.staleness >= 0
        self._epoch_windows.append(record)
        if self._metric_sum is None:
            self._metric_sum = values
        else:
            self._metric_sum = [a + b for a, b in zip(self._metric_sum, values)]

    def _metric_results(self, state):
        """The model's metric results for metric-variable values `state`."""
        mapping = list(zip(self.model.metrics_variables, state))
        with StatelessScope(state_mapping=mapping):
            return {k: float(v) for k, v in self.model.get_metrics_result().items()}

    def window_results(self, record):
        """The metric results (loss, accuracy, ...) of one window's own steps."""
        return self._metric_results(record.state)

    def reset_metrics(self):
        self._metric_init = [np.asarray(v.numpy()) for v in self.model.metrics_variables]
        self._metric_sum = None
        self._epoch_windows = []
        self._logs = None

    def metric_values(self):
        if self._metric_sum is None:
            return list(self._metric_init)
        return [i + s for i, s in zip(self._metric_init, self._metric_sum)]

    def logs(self, counters=False):
        """Metric results over the windows finished so far this epoch.

        `counters` adds the PS counters (a few reads from the PS: once an
        epoch, not once a window).
        """
        logs = self._metric_results(self.metric_values())
        if counters:
            logs.update(self.strategy.stats(self).as_logs())
        else:
            # As the epoch-end logs count them (the PS version): pushes made,
            # not windows that were skipped (NaN/Inf) or re-runs.
            logs["windows"] = self._ticketed
        pis = [r.pi for r in self._epoch_windows if r.pi is not None and r.pushed]
        if pis:
            mean = np.mean(pis, axis=(0, 1))
            logs.update(gem_pi_mean=mean[0], gem_pi_zero=mean[1], gem_pi_max=mean[2])
        return logs

    def finish(self):
        """Waits for every scheduled window; writes the epoch's metrics back.

        Raises if every window of the epoch held NaN/Inf: training cannot
        progress, and spinning on would hide it.
        """
        self.coordinator.join()
        self._drain(block=True)
        if self._epoch_windows and not any(r.pushed for r in self._epoch_windows):
            raise FloatingPointError(
                f"All {len(self._epoch_windows)} windows of this epoch computed "
                "updates with NaN or Inf; none was pushed. Lower the learning "
                "rate or check the data for NaN/Inf."
            )
        for var, value in zip(self.model.metrics_variables, self.metric_values()):
            var.assign(value)
        return self.logs(counters=True)

    # ---- worker side ------------------------------------------------------

    def _window_fn(self, iterator, num_steps, window_id):
        model, lo, counters = self.model, self.local_optimizer, self.strategy.counters
        n_train = len(model.trainable_variables)
        worker = tf.cast(tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int64)
        # Before its first window, worker i skips i batches (see
        # strategy._WindowDataset): seeded workers must not train on the same batches.
        shifted = self.data_shifted.read_value()
        for _ in tf.range(tf.where(shifted, tf.zeros_like(worker), worker)):
            next(iterator)
        # A re-run of a window that an earlier attempt (on a worker that died
        # before returning) already pushed: run nothing, push nothing.
        slot = tf.reshape(window_id % APPLIED_RING, [1])
        replayed = tf.reduce_any(
            tf.equal(self.applied_windows.sparse_read(slot), window_id + 1)
        )
        num_steps = tf.where(replayed, tf.zeros_like(num_steps), num_steps)
        # Pull.
        pulled_version = counters.version.read_value()
        start = [tf.identity(_read(_raw(v))) for v in self.variables]
        opt_values, pw = [], iter(self.worker_state)
        for v in lo.variables:
            shared = self._shared.get(id(v))
            opt_values.append(
                _raw(shared).read_value() if shared is not None else next(pw).read_value()
            )
        metric_values = [tf.constant(m) for m in self._metric_init]
        opt_values_at_pull = list(opt_values)

        def step(weights, opt_values, metric_values):
            x, y, sample_weight = unpack_x_y_sample_weight(next(iterator))
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
            trainable, opt_values = keras_hook.stateless_apply(
                lo, opt_values, grads, trainable
            )
            mapping = list(zip(model.metrics_variables, metric_values))
            with StatelessScope(state_mapping=mapping) as scope:
                model._loss_tracker.update_state(
                    loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0]
                )
                model.compute_metrics(x, y, y_pred, sample_weight)
            metric_values = [
                scope.get_current_value(v) if scope.get_current_value(v) is not None else m
                for v, m in zip(model.metrics_variables, metric_values)
            ]
            return list(trainable) + list(non_trainable), opt_values, metric_values

        weights = list(start)
        for _ in tf.range(num_steps):
            weights, opt_values, metric_values = step(weights, opt_values, metric_values)

        update = [w - s for w, s in zip(weights, start)]
        new_worker_state = [
            o for v, o in zip(lo.variables, opt_values) if id(v) not in self._shared
        ]
        if self.push_rule:
            pushed_train, rule_updates, pi_stats = self.push_rule.transform(
                update[:n_train], start[:n_train]
            )
            update = list(pushed_train) + update[n_train:]
        else:
            rule_updates, pi_stats = [], tf.zeros([0, 3])
        finite = tf.reduce_all(
            [tf.reduce_all(tf.math.is_finite(u)) for u in update if u.dtype.is_floating]
        )

        def push():
            ops, tau = push_update(
                self.variables, update, pulled_version, counters,
                self.strategy.staleness, self.strategy.max_staleness,
            )
            # Like the variables, the step count and the window's id are
            # written only once the whole update has reached the PS.
            iterations = _raw(self.model.optimizer.iterations)
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

        pushed, tau = tf.cond(replayed, replay, lambda: tf.cond(finite, push, skip))
        # Per-worker variables are captured at call time, which does not reach
        # into cond branches: write the worker's state here, keeping the old
        # state when the window was not pushed.
        old_state = [o for v, o in zip(lo.variables, opt_values_at_pull) if id(v) not in self._shared]
        state_ops = []
        with tf.control_dependencies([pushed]):
            state_ops.append(self.data_shifted.assign(True, read_value=False))
            for var, new, old in zip(self.worker_state, new_worker_state, old_state):
                state_ops.append(var.assign(tf.where(pushed, new, old), read_value=False))
            for var, new in rule_updates:
                state_ops.append(var.assign(tf.where(pushed, new, var.read_value()), read_value=False))
        with tf.control_dependencies([pushed] + state_ops):
            # One tensor, so the chief fetches a window's result in one copy.
            header = [
                worker,
                tf.logical_or(pushed, replayed),  # the update is in the central variables, once
                replayed,
                tf.timestamp(),  # under the control dependency: after the push
                tau,
            ]
            parts = [tf.reshape(tf.cast(h, tf.float64), [1]) for h in header]
            parts += [tf.reshape(tf.cast(m - i, tf.float64), [-1])
                      for m, i in zip(metric_values, self._metric_init)]
            parts.append(tf.reshape(tf.cast(pi_stats, tf.float64), [-1]))
            return tf.concat(parts, axis=0)
