"""The function a closure of windows runs on a worker, in named phases.

`WindowFunction.run` is traced into the `tf.function` that `scheduling.WindowTrainer`
schedules per closure: `K` windows back to back in a `tf.while_loop`, each with its own
pull, local steps, ticket and push, one packed row per window, stopping early once the
closure's time budget is spent. Each phase is a method (`_pull`, `_local_steps`,
`_outgoing`, `_push_skip_or_replay`, ...). Every ordering that matters is a data or
control dependency made here: TF runs an op as soon as its inputs are ready, whatever the
source order. Phases, transfers and orderings: docs/architecture.md.
"""

import typing

import numpy as np
import tensorflow as tf

from tf_asgd import internals
from tf_asgd.runtime import metric_states, optimizer_options, steps
from tf_asgd.runtime.push import (
    CentralVariables,
    Pull,
    PushCodec,
    PushGate,
    Transfer,
    branch_free,
    device_of,
    raw,
    read,
    update_specs,
)

APPLIED_RING = 1 << 16  # window ids remembered on the PS (8 bytes each)


class _Pulled(typing.NamedTuple):
    """What a window's pull read: the state its local steps start from."""

    version: tf.Tensor  # the PS version counter at pull time
    weights: list  # the central variables (trainable, then non-trainable)
    optimizer_values: (
        list  # the local optimizer's variables (shared from the PS, or the worker's own)
    )


class _Outgoing(typing.NamedTuple):
    """What a window would push, and the worker state it would keep."""

    update: list  # one tensor per central variable (after the push rule, if any)
    worker_state: list  # new values of `WindowFunction.worker_state`
    rule_updates: list  # (per-worker variable, new value) of the push rule
    pi_stats: tf.Tensor  # [n_trainable, 3], or [0, 3] without a push rule
    # Compressed pushes (`push.PushCodec.encode`): (shard, payload) per PS
    # shard, None without compression; (residual variable, new value) to keep.
    payloads: typing.Any = None
    residuals: tuple = ()


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
        # A model with its own train_step: its optimizers are built (and
        # this state made) when the window is first traced (`run`).
        self._model_step = (
            steps.ModelStep(model, trainer.variables, push_rule)
            if steps.overrides_train_step(model)
            else None
        )
        self._metrics_checked = False  # metric states checked to merge (`prepare`)
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
        if self._model_step is None:
            optimizer_options.check_compiled(model.optimizer)
            self._create_optimizer_state(
                internals.wrapped_optimizers(self.local_optimizer), self.local_optimizer.variables
            )
        with strategy.scope(), strategy.extended.colocate_vars_with(strategy.counters.version):
            # Slot `id % APPLIED_RING` holds `id + 1` once window `id` pushed.
            self.applied_windows = tf.Variable(
                tf.zeros([APPLIED_RING], tf.int64), trainable=False, name="applied_windows"
            )

    def _create_residuals(self, strategy):
        """The push's codec and, under a lossy one, the error-feedback
        residual of each compressed variable: per worker, shaped like the
        variable, zeros at first, kept across windows (also under
        `worker_state="reset"`: it is what the PS has not received yet)."""
        self._codec = PushCodec(strategy.compression)
        self.residuals = [
            internals.per_worker_variable(tf.zeros(v.shape, tf.float32), name="push_residual")
            if self._codec.compresses(v.dtype)
            else None
            for v in self._trainer.variables
        ]

    def _create_optimizer_state(self, optimizers, variables):
        """The window's optimizer state: `variables` (of `optimizers`, the
        local one first) are carried in that order. Shared: the local
        optimizer's step counter (the compiled optimizer's, so that
        `model.optimizer.iterations` counts every step applied) and each
        optimizer's learning rate on a PS, read from the PS each window, so
        schedules and callbacks such as ReduceLROnPlateau see the global
        values. The rest (momentum, Adam's moments, other optimizers' step
        counters) is the worker's own, kept in per-worker variables, except
        EMA variables (`use_ema`): the PS updates those at each push
        (`optimizer_options.CentralAverages`), and a window carries zeros
        in their place (its steps do not read them)."""
        lo, strategy = self.local_optimizer, self._trainer.strategy
        model = self._trainer.model
        with strategy.scope():
            self._opt_variables = list(variables)
            counter = internals.iteration_variable(lo)
            self._shared = {id(counter): internals.iteration_variable(model.optimizer)}
            self._counters = [counter]  # step counters advanced on the PS by a push
            for o in optimizers:
                lr, it = internals.learning_rate_variable(o), internals.iteration_variable(o)
                if lr is not None and (o is lo or "/job:ps" in device_of(raw(lr))):
                    self._shared[id(lr)] = lr
                if id(it) not in self._shared and "/job:ps" in device_of(raw(it)):
                    self._shared[id(it)] = it
                    self._counters.append(it)
            self._averages = self._central_averages(optimizers)
            self._ema = {id(a) for averages in self._averages for _, a in averages.pairs}
            initial = [read(raw(v)) for v in variables if self._is_own(v)]
            self.worker_state = [internals.per_worker_variable(v) for v in initial]
            # What `worker_state="reset"` restores at each pull: zeros for
            # the usual zero-initialised slots, else the initial values.
            self._initial_state = [None if not np.any(v.numpy()) else v.numpy() for v in initial]

    def _central_averages(self, optimizers):
        """A `CentralAverages` per optimizer with `use_ema`, on the PS (each
        counted by the step counter its pushes advance)."""
        ids = [id(c) for c in self._counters]
        out = []
        for o in optimizers:
            if not o.use_ema:
                continue
            i = ids.index(id(internals.iteration_variable(o)))
            # A push writes the compiled optimizer's counter for the local one.
            counter = self._shared[ids[0]] if i == 0 else self._counters[i]
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

    def prepare(self, iterator, element_spec=None):
        """Before the window is first traced, on the chief: for a model with
        its own `train_step`, builds its optimizers, checks that it can run
        in a window (`steps.ModelStep.prepare`) and makes the optimizer state;
        for every model, refuses a metric whose state does not merge over
        windows (`metric_states.check_training`).
        `element_spec`: the batches', for batches sent by the chief
        (`python_inputs`); else the per-worker `iterator`'s."""
        if self._model_step is not None and not self._model_step.prepared:
            self._model_step.prepare(
                element_spec or internals.per_worker_element_spec(iterator), self._trainer.strategy
            )
            self._create_optimizer_state(
                self._model_step.optimizers, self._model_step.optimizer_variables
            )
        if not self._metrics_checked:
            metric_states.check_training(
                self._trainer.model,
                self._step,
                element_spec or internals.per_worker_element_spec(iterator),
                self._trainer.variables,
                self._opt_variables,
            )
            self._metrics_checked = True

    def run(self, iterator, plan, limits):
        """A closure of windows on a worker (traced into the function the
        trainer schedules).

        Skips this worker's first batches (once), then runs the windows in
        order, each one: check for a replay, pull, local steps, compute the
        outgoing update, push it (or skip a NaN/Inf one, or nothing for a
        replay), write the worker's state, pack its row. It starts no new
        window once `budget` seconds have passed since the closure started;
        the windows it did not start are the chief's to reschedule.

        Pipelined: each window's update goes to the PS with the next
        window's id; the PS pushes it, then (after the push's writes) checks
        and pulls for the next window, and sends the push's staleness back
        with that pull. One transfer each way per window.

        Args:
            iterator: the per-worker dataset iterator.
            plan: int64 `[2, N]`: each window's id (unique; a re-run keeps
                it) and local steps (`n_sync`, or fewer for an epoch's last
                window); the first `K` are used.
            limits: float64 `[2]`: `K`, the closure's windows, and its
                budget, the seconds after which no new window starts.

        Returns:
            float64 `[windows run, row size]`: one packed result per window
            run, in order (`records.WindowResultLayout`).
        """
        return self._run(iterator, plan, limits, shift_data=True)

    def run_on_sent_batches(self, iterator, plan, limits):
        """`run` on batches the chief sent with the closure (`python_inputs`;
        `iterator` reads them): without the per-worker data shift, since
        every closure's batches already differ."""
        return self._run(iterator, plan, limits, shift_data=False)

    def _run(self, iterator, plan, limits, shift_data):
        window_ids, num_steps = plan[0], plan[1]
        count, budget = tf.cast(limits[0], tf.int32), limits[1]
        worker = tf.cast(
            tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int64
        )
        shifted = self._shift_data_once(iterator, worker) if shift_data else tf.zeros_like(worker)
        with tf.control_dependencies([shifted]):
            start = tf.timestamp()
        self._pull_plan = pull = Pull(
            self._trainer.variables,
            [self._shared[id(v)] for v in self._opt_variables if id(v) in self._shared],
            self._trainer.strategy.counters,
            self._already_pushed,
            self._trainer.strategy.pull_compression,
        )
        self._cdev = pull.cdev
        with tf.device(pull.cdev):
            flats = pull.read(tf.identity(plan[:, 0]))
        flats = pull.to_worker(flats)[1]
        rows = tf.TensorArray(
            tf.float64, size=0, dynamic_size=True, element_shape=[self._trainer.layout.size]
        )

        def window(k, token, rows, has_next, flats):
            row, has_next, flats = self._window(
                iterator, worker, k, num_steps, window_ids, (count, budget, start), token, flats
            )
            return k + 1, row[0], rows.write(k, row), has_next, flats

        loop = (tf.constant(0), tf.zeros([], tf.float64), rows, tf.constant(True), flats)
        shapes = (
            tf.TensorShape([]),
            tf.TensorShape([]),
            tf.TensorShape(None),
            tf.TensorShape([]),
            [tf.TensorShape([None])] * len(flats),
        )
        _, _, rows, _, _ = tf.while_loop(
            lambda k, token, rows, has_next, flats: has_next,
            window,
            loop,
            shape_invariants=shapes,
            parallel_iterations=1,
        )
        return rows.stack()

    def _window(self, iterator, worker, k, num_steps, window_ids, limits, token, flats):
        """Window `k`: its phases on the worker after `token` (the previous
        window's row), from the pull `flats` (the PS made it after the
        previous window's push). Returns its packed row, whether a next
        window follows, and the next window's pull."""
        with tf.control_dependencies([token]):
            started_at = tf.timestamp()
        pulled, replayed = self._pull(flats, token)
        steps = tf.where(replayed, tf.zeros_like(num_steps[k]), num_steps[k])
        weights, opt_values, metric_values, samples = self._local_steps(iterator, steps, pulled)
        with tf.control_dependencies([token]):
            outgoing = self._outgoing(pulled, weights, opt_values)
        count, budget, start = limits
        # A compressed push's new residuals too: a codec may drop (top-k) or
        # overflow (bf16) what the update holds.
        checked = list(outgoing.update) + [r for _, r in outgoing.residuals]
        finite = tf.reduce_all(
            [tf.reduce_all(tf.math.is_finite(u)) for u in checked if u.dtype.is_floating]
        )
        ok = tf.logical_and(finite, tf.logical_not(replayed))
        with tf.control_dependencies([finite]):  # once the local steps are done
            has_next = tf.logical_and(k + 1 < count, tf.timestamp() - start < budget)
        following = tf.minimum(k + 1, num_steps.shape[0] - 1)
        advanced = self._advanced(pulled, opt_values)
        meta = tf.stack(
            [
                window_ids[k],
                advanced[0],
                pulled.version,
                tf.cast(ok, tf.int64),
                tf.cast(tf.logical_not(tf.logical_or(finite, replayed)), tf.int64),
                window_ids[following],
                num_steps[following],
                tf.cast(has_next, tf.int64),
            ]
            + advanced[1:]
        )
        tau, flats = self._push_skip_or_replay(outgoing, ok, meta, has_next)
        state_ops = self._write_worker_state(ok, pulled, outgoing)
        with tf.control_dependencies(state_ops):
            header = dict(worker=worker, pushed=ok, replayed=replayed, staleness=tau)
            header.update(started_at=started_at, samples=samples)
            row = self._pack_result(header, metric_values, outgoing.pi_stats)
        return row, has_next, flats

    def _advanced(self, pulled, opt_values):
        """How far the window advances each of `_counters` (int64): how often
        its steps applied each optimizer (Keras's step: once a step, except
        steps a `LossScaleOptimizer` skipped, which Keras does not count)."""
        ids = [id(v) for v in self._opt_variables]
        out = []
        for counter in self._counters:
            i = ids.index(id(counter))
            out.append(tf.cast(opt_values[i] - pulled.optimizer_values[i], tf.int64))
        return out

    def _shift_data_once(self, iterator, worker):
        """Before its first window, worker `i` skips `i` batches (see
        `strategy._WindowDataset`): seeded workers must not train on the same
        batches. `data_shifted` is set by `_write_worker_state`. Returns a
        tensor that exists once the batches are skipped."""
        shifted = self.data_shifted.read_value()
        skip = tf.where(shifted, tf.zeros_like(worker), worker)

        def next_batch(i):
            with tf.control_dependencies(tf.nest.flatten(next(iterator))):
                return i + 1

        return tf.while_loop(lambda i: i < skip, next_batch, [tf.zeros_like(skip)])[0]

    def _already_pushed(self, ids):
        """Whether an earlier attempt of window `ids[0]` (on a worker that
        died before returning) already pushed; a replay then runs nothing and
        pushes nothing. On the counters' PS; a bool scalar."""
        slot = tf.reshape(ids[0] % APPLIED_RING, [1])
        return tf.reduce_any(tf.equal(self.applied_windows.sparse_read(slot), ids[0] + 1))

    def _pull(self, flats, token):
        """Pull, from the flat tensors the PS sent (`push.Pull`): the version
        counter, the replay flag, the central variables and the local
        optimizer's state (the step counter and learning rate from the PS,
        the rest from this worker's own variables, read after `token`).
        Returns `(pulled, replayed)`: a `_Pulled` and a bool scalar."""
        meta, shared, weights = self._pull_plan.unpack(flats)
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
        return _Pulled(meta[2], weights, self._merge(shared, own)), meta[1] > 0

    def _merge(self, shared, own):
        """The local optimizer's variable values in its order, from the
        values of its shared variables and of its own (each in order), with
        zeros for EMA variables."""
        shared, own = list(shared), list(own)
        return [
            shared.pop(0)
            if id(v) in self._shared
            else own.pop(0)
            if id(v) not in self._ema
            else tf.zeros(v.shape, v.dtype)
            for v in self._opt_variables
        ]

    def _local_steps(self, iterator, num_steps, pulled):
        """Local steps: `num_steps` steps of the local optimizer on the worker's
        own batches, with weights, optimizer state and metric state carried as
        loop tensors; nothing is written to any variable meanwhile. Returns
        `(weights, optimizer_values, metric_values, samples)` after the last
        step, `samples` the batches' sizes summed (int64)."""
        metric_values = [tf.constant(m) for m in self._trainer.metric_init]
        weights, opt_values = list(pulled.weights), list(pulled.optimizer_values)
        # `compile(jit_compile=True)`: each step XLA-compiled, as Keras compiles its step.
        step = (
            tf.function(self._step, jit_compile=True)
            if self._trainer.model.jit_compile
            else self._step
        )

        def one_step(i, samples, weights, opt_values, metric_values):
            batch = next(iterator)
            out = step(batch, weights, opt_values, metric_values)
            return (i + 1, samples + batch_size(batch), *map(list, out))

        loop = (tf.zeros_like(num_steps), tf.constant(0, tf.int64))
        _, samples, weights, opt_values, metric_values = tf.while_loop(
            lambda i, *_: i < num_steps, one_step, (*loop, weights, opt_values, metric_values)
        )
        return list(weights), list(opt_values), list(metric_values), samples

    def _step(self, batch, weights, opt_values, metric_values):
        """One training step on loop tensors (`steps.py`): the model's own
        `train_step` if its class has one, else Keras's step."""
        if self._model_step is not None:
            return self._model_step.step(batch, weights, opt_values, metric_values)
        return steps.keras_step(
            self._trainer.model, self.local_optimizer, batch, weights, opt_values, metric_values
        )

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
        if not self._codec.compression.lossy:
            return _Outgoing(update, worker_state, rule_updates, pi_stats)
        payloads, residuals = self._codec.encode(self._trainer.variables, update, self.residuals)
        return _Outgoing(update, worker_state, rule_updates, pi_stats, payloads, residuals)

    def _own(self, opt_values):
        """The entries of `opt_values` kept in `worker_state` (not shared with the PS)."""
        return [o for v, o in zip(self._opt_variables, opt_values) if self._is_own(v)]

    def _push_skip_or_replay(self, outgoing, ok, meta, has_next):
        """One round on the PS: push, skip or replay this window, then pull
        for the next one.

        The update travels with `meta` (`[window_id, num_steps, pulled
        version, ok, bad, next id, next steps, has_next]`, int64); `ok`
        (finite, not a replay) decides on the PS (`push.CentralVariables.apply`):

        - push: the ticket is taken only once the whole update is on the PS;
          under it, the update, the step count and the window's id in
          `applied_windows` are written;
        - skip (`bad`: the update holds NaN/Inf): count it in
          `dropped_nonfinite`;
        - replay: nothing.

        Then, if `has_next`, each PS reads the next window's pull after its
        writes of this push. Returns `(tau, flats)` on the worker: the push's
        staleness (-1 when not pushed) and the next pull.
        """
        strategy, counters = self._trainer.strategy, self._trainer.strategy.counters
        free = branch_free(self._trainer.outer_slots)
        payloads = outgoing.payloads
        if payloads is None:  # uncompressed: each piece as it is
            payloads = update_specs(self._trainer.variables, outgoing.update)
            payloads = [(s, (p,)) for s, p in payloads]
        pieces = [(s, t) for s, payload in payloads for t in payload]  # what crosses to the PS
        pull = self._pull_plan
        others = [d for d in pull.transfer.devices() if d != self._cdev]
        tensors = [p for _, p in pieces]
        if free:  # what is not pushed must add exactly 0 (NaN-safe); zeros only then
            tensors = tf.cond(ok, lambda: tensors, lambda: [tf.zeros_like(p) for p in tensors])
        tensors = list(tensors) + [meta] + [tf.cast(has_next, tf.uint8) for _ in others]
        transfer = Transfer(
            [(s.device, p.shape, p.dtype) for s, p in pieces]
            + [(self._cdev, meta.shape, tf.int64)]
            + [(d, [], tf.uint8) for d in others]
        )
        arrived, landed = transfer.send(tensors)
        meta = arrived[len(pieces)]
        with tf.device(self._cdev):  # (a slice made elsewhere would travel)
            ok_ps, bad, version = meta[3] > 0, meta[4] > 0, meta[2]
            slot = tf.reshape(meta[0] % APPLIED_RING, [1])

        def skipped():
            counted = counters.dropped_nonfinite.assign_add(
                tf.cast(bad, tf.int64), read_value=False
            )
            with tf.control_dependencies([counted]):
                return tf.constant(-1, tf.int64)

        def writes(tau, push):
            # Like the variables, the step count and the window's id are
            # written only once the whole update has reached the PS.
            iterations = raw(internals.iteration_variable(self._trainer.model.optimizer))
            steps, window_id = meta[1:2], meta[0] + 1  # the counters' advances: meta[1], meta[8:]
            with tf.device(self._cdev):
                steps = tf.concat([steps, meta[8:]], 0)
                if push is not None:  # branch-free: no change unless pushed
                    steps = steps * tf.cast(push, tf.int64)
                    window_id = tf.where(push, window_id, self.applied_windows.sparse_read(slot)[0])
                applied = tf.raw_ops.ResourceScatterUpdate(
                    resource=self.applied_windows.handle,
                    indices=slot,
                    updates=tf.reshape(window_id, [1]),
                )
            ops = [applied]
            for i, counter in enumerate([iterations] + [raw(c) for c in self._counters[1:]]):
                with tf.device(counter.device):
                    ops.append(
                        counter.assign_add(tf.cast(steps[i], counter.dtype), read_value=False)
                    )
            return ops

        central = CentralVariables(
            self._trainer.variables,
            counters,
            strategy.staleness,
            strategy.max_staleness,
            self._trainer.outer,
            self._trainer.outer_slots,
            strategy.num_workers,
        )
        gate = PushGate(ok=ok_ps, skipped=skipped, writes=writes)
        updates = self._codec.decode(payloads, arrived[: len(pieces)])  # each on its PS
        _, tau = central.apply(updates, landed, version, gate)
        done = tau
        if self._averages:  # the EMA of the central variables after this push
            with tf.device(self._cdev):
                advances = tf.concat([meta[1:2], meta[8:]], 0) * tf.cast(ok_ps, tf.int64)
                ticket = version + tau
            ema = [op for a in self._averages for op in a.update(advances[a.index], ticket, tau)]
            with tf.device(self._cdev), tf.control_dependencies(ema):
                done = tf.identity(tau)
        flats = []
        for d in pull.transfer.devices():
            # After every write of the push (`tau` waits for them all; the
            # step counter read here may live on another PS than it is written from).
            with tf.device(d), tf.control_dependencies([tau.op]):
                go = (
                    meta[7] > 0
                    if d == self._cdev
                    else arrived[len(pieces) + 1 + others.index(d)] > 0
                )
                flats += tf.cond(
                    go, lambda d=d: pull.read(meta[5:7], d), lambda d=d: pull.transfer.empty(d)
                )
        return pull.to_worker(flats, done)

    def _write_worker_state(self, pushed, pulled, outgoing):
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
            old = self._own(pulled.optimizer_values) + [var.read_value() for var, _ in kept]
            new = list(outgoing.worker_state) + [value for _, value in kept]
            # A cond selects without copying (a `where` would copy every tensor).
            values = tf.cond(pushed, lambda: new, lambda: old) if new else []
            state_ops = [self.data_shifted.assign(True, read_value=False)]
            state_ops += [
                var.assign(value, read_value=False) for var, value in zip(variables, values)
            ]
        return state_ops

    def _pack_result(self, header, metric_values, pi_stats):
        """The window's row (`records.WindowResultLayout`) from `header`'s
        fields but `finished_at`; call under control dependencies on the state
        writes, so that the timestamp is taken after them (and, through the
        staleness `tau`, after the push)."""
        header = dict(
            header,
            # A replay's update is in the central variables already, once.
            pushed=tf.logical_or(header["pushed"], header["replayed"]),
            finished_at=tf.timestamp(),  # under the control dependency: after the state writes
        )
        deltas = [m - i for m, i in zip(metric_values, self._trainer.metric_init)]
        return self._trainer.layout.pack(header, deltas, pi_stats)


def batch_size(batch):
    """The number of samples in `batch` (its first element's leading dimension;
    rows for a ragged or sparse one), int64."""
    first = tf.nest.flatten(batch)[0]
    if isinstance(first, tf.RaggedTensor):
        return first.nrows(out_type=tf.int64)
    if isinstance(first, tf.SparseTensor):
        return first.dense_shape[0]
    return tf.shape(first, out_type=tf.int64)[0]
