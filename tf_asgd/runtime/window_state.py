"""The worker-side state a window function keeps, and what a window carries between phases.

`WindowState` creates and owns the state `window.WindowFunction` reads and writes across
windows: the local optimizer and its per-worker state, the push rule's, the compressed
push's residuals, the central EMA averages, the data-shift flag and the PS's ring of
applied window ids. `Pulled` and `Outgoing` are what one window's phases hand on.
"""

import typing

import numpy as np
import tensorflow as tf

from tf_asgd import internals
from tf_asgd.runtime import optimizer_options
from tf_asgd.runtime.push import PushCodec, device_of, raw, read
from tf_asgd.runtime.rounds import RoundStart

APPLIED_RING = 1 << 16  # window ids remembered on the PS (8 bytes each)


class Pulled(typing.NamedTuple):
    """What a window's pull read: the state its local steps start from."""

    version: tf.Tensor  # the PS version counter at pull time
    weights: list  # the central variables (trainable, then non-trainable)
    optimizer_values: (
        list  # the local optimizer's variables (shared from the PS, or the worker's own)
    )
    global_steps: typing.Any = None  # the compiled optimizer's step count on the PS


class Outgoing(typing.NamedTuple):
    """What a window would push, and the worker state it would keep."""

    update: list  # one tensor per central variable (after the push rule, if any)
    worker_state: list  # new values of `WindowState.worker_state`
    rule_updates: list  # (per-worker variable, new value) of the push rule
    pi_stats: tf.Tensor  # [n_trainable, 3], or [0, 3] without a push rule
    # Compressed pushes (`push.PushCodec.encode`): (shard, payload) per PS
    # shard, None without compression; (residual variable, new value) to keep.
    payloads: typing.Any = None
    residuals: tuple = ()


class WindowState:
    """The state a model's windows keep across windows, on the workers and the PS.

    Creates, under the strategy's scope and in this order: the local optimizer
    (the compiled one, or the push rule's), the push rule's per-worker state,
    the data-shift flag, the compressed push's residuals, then (unless the
    model has its own `train_step`: `create_optimizer_state` is then called
    once its optimizers are built) the optimizer state, and the ring of
    applied window ids on the PS.

    Args:
        trainer: the `scheduling.WindowTrainer` it keeps the state for. Read
            from it: `model`, `strategy`, `variables` and `push_rule` (the
            model each time: the trainer holds it weakly).
        own_train_step: whether the model has its own `train_step`.
    """

    def __init__(self, trainer, own_train_step):
        self._trainer = trainer
        self.round_start = None  # synchronous rounds: `start_rounds`
        model, strategy, push_rule = trainer.model, trainer.strategy, trainer.push_rule
        with strategy.scope():
            self.local_optimizer = (
                push_rule.local_optimizer(model.trainable_variables)
                if push_rule
                else model.optimizer
            )
            if push_rule:
                push_rule.create_worker_state(model.trainable_variables)
            self.data_shifted = internals.per_worker_variable(False)
            self._create_residuals(strategy)
        if not own_train_step:
            optimizer_options.check_compiled(model.optimizer)
            self.create_optimizer_state(
                internals.wrapped_optimizers(self.local_optimizer), self.local_optimizer.variables
            )
        with strategy.scope(), strategy.extended.colocate_vars_with(strategy.counters.version):
            # Slot `id % APPLIED_RING` holds `id + 1` once window `id` pushed.
            self.applied_windows = tf.Variable(
                tf.zeros([APPLIED_RING], tf.int64), trainable=False, name="applied_windows"
            )

    def start_rounds(self):
        """The `rounds.RoundStart` that synchronous windows pull, created on
        first use (once the optimizer state exists; before the window is
        traced)."""
        if self.round_start is None:
            strategy = self._trainer.strategy
            with strategy.scope():
                self.round_start = RoundStart(
                    self._trainer.variables, self.shared_variables(), strategy.counters
                )
        return self.round_start

    def _create_residuals(self, strategy):
        """The push's codec and, under a lossy one, the error-feedback
        residual of each compressed variable: per worker, shaped like the
        variable, zeros at first, kept across windows (also under
        `worker_state="reset"`: it is what the PS has not received yet)."""
        self.codec = PushCodec(strategy.compression)
        self.residuals = [
            internals.per_worker_variable(tf.zeros(v.shape, tf.float32), name="push_residual")
            if self.codec.compresses(v.dtype)
            else None
            for v in self._trainer.variables
        ]

    def forget_data_shift(self):
        """Each worker skips its offset of batches again before its next window: its
        iterator was made anew (`WindowTrainer.rebuild_input`). Queued on every worker
        before any window."""
        flag = self.data_shifted

        def reset():
            with tf.control_dependencies([flag.assign(False, read_value=False)]):
                return tf.constant(0)

        internals.on_every_worker(
            self._trainer.strategy.coordinator, tf.function(reset, autograph=False)
        )

    def create_optimizer_state(self, optimizers, variables):
        """The window's optimizer state: `variables` (of `optimizers`, the
        local one first) are carried in that order.

        The local optimizer's step counter is the worker's own: its steps since
        its moments began, so that what an optimizer derives from it for its
        own moments (Adam's bias correction) matches them. Its schedules see
        the global count instead (`WindowFunction._workers_rate`), and a push
        advances the compiled optimizer's counter on the PS by the window's
        steps, so `model.optimizer.iterations` counts every step applied.
        Shared, read from the PS each window: each optimizer's learning rate
        (so schedules and callbacks such as ReduceLROnPlateau act on every
        worker) and other optimizers' step counters on a PS (not separated:
        `local_steps_own`). The rest (momentum, Adam's moments) is the
        worker's own, kept in per-worker variables, except EMA variables
        (`use_ema`): the PS updates those at each push
        (`optimizer_options.CentralAverages`), and a window carries zeros
        in their place (its steps do not read them)."""
        lo, strategy = self.local_optimizer, self._trainer.strategy
        model = self._trainer.model
        with strategy.scope():
            self.optimizer_variables = list(variables)
            counter = internals.iteration_variable(lo)
            # Read at each pull beside the shared variables: what schedules see.
            self.global_steps = internals.iteration_variable(model.optimizer)
            self._shared = {}
            self.counters = [counter]  # step counters advanced on the PS by a push
            for o in optimizers:
                lr, it = internals.learning_rate_variable(o), internals.iteration_variable(o)
                if lr is not None and (o is lo or "/job:ps" in device_of(raw(lr))):
                    self._shared[id(lr)] = lr
                if it is counter or id(it) in self._shared:
                    continue
                if "/job:ps" in device_of(raw(it)):
                    self._shared[id(it)] = it
                    self.counters.append(it)
            self.local_steps_own = len(self.counters) == 1
            self.averages = self._central_averages(optimizers)
            self._ema = {id(a) for averages in self.averages for _, a in averages.pairs}
            own = [v for v in variables if self._is_own(v)]
            initial = [read(raw(v)) for v in own]
            # Moments that start at zero start with no steps (a fresh model, or one
            # whose moments were never written on the PS); restored moments keep the
            # restored count, as one Keras process would.
            if not any(np.any(v.numpy()) for v, o in zip(initial, own) if o is not counter):
                initial = [tf.zeros_like(v) if o is counter else v for v, o in zip(initial, own)]
            self.worker_state = [internals.per_worker_variable(v) for v in initial]
            # What `worker_state="reset"` restores at each pull: zeros for
            # the usual zero-initialised slots, else the initial values.
            self._initial_state = [None if not np.any(v.numpy()) else v.numpy() for v in initial]

    def _central_averages(self, optimizers):
        """A `CentralAverages` per optimizer with `use_ema`, on the PS (each
        counted by the step counter its pushes advance)."""
        ids = [id(c) for c in self.counters]
        out = []
        for o in optimizers:
            if not o.use_ema:
                continue
            i = ids.index(id(internals.iteration_variable(o)))
            # A push writes the compiled optimizer's counter for the local one.
            counter = self.global_steps if i == 0 else self.counters[i]
            out.append(
                optimizer_options.CentralAverages(
                    o, counter, i, self._trainer.variables, self._trainer.strategy
                )
            )
        return out

    def _is_own(self, variable):
        """Whether an optimizer variable is the worker's own state (neither
        read from the PS at each pull nor an EMA variable)."""
        return id(variable) not in self._shared and id(variable) not in self._ema

    def shared_variables(self):
        """What a pull reads from the PS beside the weights: the shared optimizer
        variables in order, then the global step counter (`global_steps`)."""
        shared = [self._shared[id(v)] for v in self.optimizer_variables if id(v) in self._shared]
        return shared + [self.global_steps]

    def counted_steps(self):
        """The step counters a push advances, as the PS writes them: the
        compiled optimizer's for the local one, then the others."""
        iterations = raw(internals.iteration_variable(self._trainer.model.optimizer))
        return [iterations] + [raw(c) for c in self.counters[1:]]

    def optimizer_values(self, shared, token):
        """The local optimizer's variable values in its order, for a window's
        local steps: `shared` (the values of `shared_variables()`, as pulled), the
        worker's own state (read after `token`, or under
        `worker_state="reset"` its initial values) and zeros for EMA
        variables."""
        reset = self._trainer.strategy.worker_state == "reset"
        own = []
        for var, initial in zip(self.worker_state, self._initial_state):
            if not reset:
                with tf.control_dependencies([token]):
                    own.append(var.read_value())
            elif initial is None:
                own.append(tf.zeros(var.shape, var.dtype))
            else:
                own.append(tf.constant(initial))
        shared = list(shared)
        return [
            shared.pop(0)
            if id(v) in self._shared
            else own.pop(0)
            if id(v) not in self._ema
            else tf.zeros(v.shape, v.dtype)
            for v in self.optimizer_variables
        ]

    def own(self, opt_values):
        """The entries of `opt_values` kept in `worker_state` (not shared with the PS)."""
        return [o for v, o in zip(self.optimizer_variables, opt_values) if self._is_own(v)]

    def advances(self, pulled, opt_values):
        """How far the window advances each of `counters` (int64): how often
        its steps applied each optimizer (Keras's step: once a step, except
        steps a `LossScaleOptimizer` skipped, which Keras does not count)."""
        ids = [id(v) for v in self.optimizer_variables]
        out = []
        for counter in self.counters:
            i = ids.index(id(counter))
            out.append(tf.cast(opt_values[i] - pulled.optimizer_values[i], tf.int64))
        return out

    def already_pushed(self, window_id):
        """Whether an earlier attempt of window `window_id` (on a worker that
        died before returning) already pushed; a replay then runs nothing and
        pushes nothing. On the counters' PS; a bool scalar."""
        slot = tf.reshape(window_id % APPLIED_RING, [1])
        return tf.reduce_any(tf.equal(self.applied_windows.sparse_read(slot), window_id + 1))

    def mark_applied(self, window_id, push):
        """On the counters' PS, under the push's ticket: the write of window
        `window_id` into the applied ring. `push`: None when it runs only for
        a push, else a bool scalar (branch-free: the slot keeps its value
        unless pushed)."""
        slot = tf.reshape(window_id % APPLIED_RING, [1])
        value = window_id + 1
        if push is not None:
            value = tf.where(push, value, self.applied_windows.sparse_read(slot)[0])
        return tf.raw_ops.ResourceScatterUpdate(
            resource=self.applied_windows.handle, indices=slot, updates=tf.reshape(value, [1])
        )

    def write(self, pushed, pulled, outgoing):
        """Writes the worker's own state: the data-shift flag, the local
        optimizer's state, the push rule's state and a compressed push's
        residuals, the new values if the window pushed, else the old ones
        (a skipped or replayed push keeps its residual for the next).

        Per-worker variables are captured at call time, which does not reach
        into cond branches: they are written here, outside the `tf.cond` of
        the push, under a control dependency on its outcome. Returns the
        write ops.
        """
        # The push rule's state, then the compressed push's residuals.
        kept = list(outgoing.rule_updates) + list(outgoing.residuals)
        variables = self.worker_state + [var for var, _ in kept]
        with tf.control_dependencies([pushed]):
            old = self.own(pulled.optimizer_values) + [var.read_value() for var, _ in kept]
            new = list(outgoing.worker_state) + [value for _, value in kept]
            # A cond selects without copying (a `where` would copy every tensor).
            values = tf.cond(pushed, lambda: new, lambda: old) if new else []
            state_ops = [self.data_shifted.assign(True, read_value=False)]
            state_ops += [
                var.assign(value, read_value=False) for var, value in zip(variables, values)
            ]
        return state_ops
