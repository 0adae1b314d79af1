"""The function a closure of windows runs on a worker, in named phases.

`WindowFunction.run` is traced into the `tf.function` that `scheduling.WindowTrainer`
schedules per closure: `K` windows back to back in a `tf.while_loop`, each with its own
pull, local steps, ticket and push, one packed row per window, stopping early once the
closure's time budget is spent. Each phase is a method (`_pull`, `_local_steps`,
`_outgoing`, ...), the round on the PS a `window_push.PushRound`, the state kept across
windows a `window_state.WindowState`. Every ordering that matters is a data or control
dependency: TF runs an op as soon as its inputs are ready, whatever the source order.
Phases, transfers and orderings: docs/architecture.md.
"""

import contextlib

import tensorflow as tf
import tensorflow.experimental.numpy as tnp

from tf_asgd import internals
from tf_asgd.rules import outer_optimizers, worker_rate
from tf_asgd.runtime import metric_states, steps
from tf_asgd.runtime.push import Pull
from tf_asgd.runtime.records import PushMeta
from tf_asgd.runtime.window_push import PushRound
from tf_asgd.runtime.window_state import APPLIED_RING, Outgoing, Pulled, WindowState

__all__ = ["APPLIED_RING", "WindowFunction", "batch_size"]


class WindowFunction:
    """One window's work on a worker; the state it keeps is `state`.

    Creates, under the strategy's scope, the worker-side state
    (`window_state.WindowState`): the local optimizer (the compiled one, or
    the push rule's), its per-worker state, the push rule's per-worker
    state, the data-shift flag, and the ring of applied window ids on the PS.

    Args:
        trainer: the `scheduling.WindowTrainer` it runs for. Read from it:
            `model`, `strategy`, `variables`, `push_rule`, `layout`, and, when
            traced, `metric_init` (the metric values a window starts from),
            `outer` and `outer_slots` (`window_push.PushRound`).
    """

    def __init__(self, trainer):
        self._trainer = trainer
        model = trainer.model
        # A model with its own train_step: its optimizers are built (and
        # its optimizer state made) when the window is first traced (`run`).
        self._model_step = (
            steps.ModelStep(model, trainer.variables, trainer.push_rule)
            if steps.overrides_train_step(model)
            else None
        )
        self._metrics_checked = False  # metric states checked to merge (`prepare`)
        # In a trace: the running fit's (first step, last step, warm-up steps) tensors,
        # and the global step count minus the worker's own at the window's pull.
        self._fit_span = self._step_offset = None
        self.state = WindowState(trainer, own_train_step=self._model_step is not None)

    @property
    def local_optimizer(self):
        """The optimizer of the local steps (the compiled one, or the push rule's)."""
        return self.state.local_optimizer

    @property
    def worker_state(self):
        """The local optimizer's per-worker variables (its own state)."""
        return self.state.worker_state

    @property
    def residuals(self):
        """Per central variable, a compressed push's per-worker residual, or None."""
        return self.state.residuals

    @property
    def data_shifted(self):
        """The per-worker flag: this worker skipped its first batches."""
        return self.state.data_shifted

    @property
    def applied_windows(self):
        """The ring of applied window ids on the PS (`APPLIED_RING`)."""
        return self.state.applied_windows

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
            self.state.create_optimizer_state(
                self._model_step.optimizers, self._model_step.optimizer_variables
            )
        if not self._metrics_checked:
            metric_states.check_training(
                self._trainer.model,
                self._step,
                element_spec or internals.per_worker_element_spec(iterator),
                self._trainer.variables,
                self.state.optimizer_variables,
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
            limits: float64 `[5]`: `K`, the closure's windows; its budget,
                the seconds after which no new window starts; the running
                fit's first global step and its warm-up steps, from which the
                workers' rate is warmed up and annealed; and 1 where
                every worker reads all the data (each then skips its index in
                batches once), 0 where each reads its shard (`closure_limits`).

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
        self._fit_span = (limits[2], limits[3])  # read by `_workers_rate`
        worker = tf.cast(
            tf.distribute.coordinator.experimental_get_current_worker_index(), tf.int64
        )
        # Worker i skips i batches once where every worker reads all the data.
        skip = worker * tf.cast(limits[4], tf.int64)
        shifted = self._shift_data_once(iterator, skip) if shift_data else tf.zeros_like(worker)
        with tf.control_dependencies([shifted]):
            start = tf.timestamp()
        self._pull_plan = pull = Pull(
            self._trainer.variables,
            self.state.shared_variables(),
            self._trainer.strategy.counters,
            self.state.already_pushed,
            self._trainer.strategy.pull_compression,
            self.state.round_start,  # synchronous: the round's start, not the live variables
        )
        self._push_round = PushRound(self._trainer, self.state, pull)
        with tf.device(pull.cdev):
            flats = pull.read(tf.identity(window_ids[0]))
        flats = pull.to_worker(flats)[1]
        rows = tf.TensorArray(
            tf.float64, size=0, dynamic_size=True, element_shape=[self._trainer.log.layout.size]
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
        window_steps = tf.where(replayed, tf.zeros_like(num_steps[k]), num_steps[k])
        weights, opt_values, metric_values, samples = self._local_steps(
            iterator, window_steps, pulled
        )
        with tf.control_dependencies([token]):
            outgoing = self._outgoing(pulled, weights, opt_values, window_steps)
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
        meta = PushMeta(
            window_id=window_ids[k],
            version=pulled.version,
            ok=ok,
            bad=tf.logical_not(tf.logical_or(finite, replayed)),  # NaN/Inf, not a replay
            next_id=window_ids[tf.minimum(k + 1, window_ids.shape[0] - 1)],
            has_next=has_next,
            steps=window_steps,
            advances=self.state.advances(pulled, opt_values),
        )
        tau, flats = self._push_round.run(outgoing, meta)
        state_ops = self.state.write(ok, pulled, outgoing)
        with tf.control_dependencies(state_ops):
            header = dict(worker=worker, pushed=ok, replayed=replayed, staleness=tau)
            header.update(started_at=started_at, samples=samples)
            row = self._pack_result(header, metric_values, outgoing.pi_stats)
        return row, has_next, flats

    def _shift_data_once(self, iterator, worker):
        """Before its first window, a worker skips `worker` batches (its index
        where every worker reads all the data, see `strategy._WindowDataset`;
        else 0): seeded workers must not train on the same batches.
        `data_shifted` is set by `WindowState.write`. Returns a tensor that
        exists once the batches are skipped."""
        shifted = self.data_shifted.read_value()
        skip = tf.where(shifted, tf.zeros_like(worker), worker)

        def next_batch(i):
            with tf.control_dependencies(tf.nest.flatten(next(iterator))):
                return i + 1

        return tf.while_loop(lambda i: i < skip, next_batch, [tf.zeros_like(skip)])[0]

    def _pull(self, flats, token):
        """Pull, from the flat tensors the PS sent (`push.Pull`): the version
        counter, the replay flag, the central variables and the local
        optimizer's state (the step counter and learning rate from the PS,
        the rest from this worker's own variables, read after `token`).
        Returns `(pulled, replayed)`: a `Pulled` and a bool scalar."""
        meta, shared, weights = self._pull_plan.unpack(flats)
        optimizer_values = self.state.optimizer_values(shared, token)
        pulled = Pulled(meta.version, weights, optimizer_values, global_steps=shared[-1])
        return pulled, meta.replayed

    def _local_steps(self, iterator, num_steps, pulled):
        """Local steps: `num_steps` steps of the local optimizer on the worker's
        own batches, with weights, optimizer state and metric state carried as
        loop tensors; nothing is written to any variable meanwhile. Returns
        `(weights, optimizer_values, metric_values, samples)` after the last
        step, `samples` the batches' sizes summed (int64)."""
        metric_values = [tf.constant(m) for m in self._trainer.log.metric_init]
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
        counter = self.state.counters[0]
        i = next(i for i, v in enumerate(self.state.optimizer_variables) if v is counter)
        own = pulled.optimizer_values[i]
        self._step_offset = tf.cast(pulled.global_steps, tf.int64) - tf.cast(own, tf.int64)
        with self._workers_rate():
            _, samples, weights, opt_values, metric_values = tf.while_loop(
                lambda i, *_: i < num_steps, one_step, (*loop, weights, opt_values, metric_values)
            )
        return list(weights), list(opt_values), list(metric_values), samples

    def _workers_rate(self):
        """While the local steps are traced: the local optimizer at the workers'
        rate, its own times the trainer's factor, both at the global step count
        (the worker's own count, which its moments' bias correction sees, plus
        `_step_offset`). Each fit warms the factor up from 1 to `lr_scale_peak`
        over its first `lr_warmup_steps` steps, then lowers it toward `lr_scale`
        (`worker_rate.annealed_rate_scale`; the fit's first step and the warm-up
        are the closure's `limits`)."""
        t = self._trainer
        peak, final = t.lr_scale_peak, t.lr_scale
        if peak == final == 1.0 and not internals.has_rate_schedule(self.local_optimizer):
            return contextlib.nullcontext()
        first, warmup = (tf.cast(v, tf.float32) for v in self._fit_span)
        return internals.scaled_learning_rate(
            self.local_optimizer,
            lambda step: worker_rate.annealed_rate_scale(
                peak, final, tf.cast(step, tf.float32) - first, warmup, tnp
            ),
            step_offset=self._step_offset,
        )

    def _step(self, batch, weights, opt_values, metric_values):
        """One training step on loop tensors (`steps.py`): the model's own
        `train_step` if its class has one, else Keras's step."""
        if self._model_step is not None:
            return self._model_step.step(batch, weights, opt_values, metric_values)
        return steps.keras_step(
            self._trainer.model, self.local_optimizer, batch, weights, opt_values, metric_values
        )

    def _outgoing(self, pulled, weights, opt_values, num_steps):
        """The update to push (`weights - pulled`, the trainable part passed
        through the push rule, e.g. GEM's `pi * g`; a moving average's
        `outer_optimizers.moving_average_sent` after the window's `num_steps`) and the
        worker state to keep if it is pushed. Returns an `Outgoing`."""
        n_train = len(self._trainer.model.trainable_variables)
        k = tf.cast(num_steps, tf.float64)

        def sent(end, start, momentum):
            if momentum is None:
                return end - start
            wide = [tf.cast(t, tf.float64) for t in (end, start)]
            return tf.cast(outer_optimizers.moving_average_sent(*wide, momentum, k, tnp), end.dtype)

        momenta = self._trainer.moving_average_momenta
        update = [sent(w, s, m) for w, s, m in zip(weights, pulled.weights, momenta)]
        worker_state = self.state.own(opt_values)
        if self._trainer.push_rule:
            pushed_train, rule_updates, pi_stats = self._trainer.push_rule.transform(
                update[:n_train], pulled.weights[:n_train]
            )
            update = list(pushed_train) + update[n_train:]
        else:
            rule_updates, pi_stats = [], tf.zeros([0, 3])
        codec = self.state.codec
        if not codec.compression.lossy:
            return Outgoing(update, worker_state, rule_updates, pi_stats)
        payloads, residuals = codec.encode(self._trainer.variables, update, self.residuals)
        return Outgoing(update, worker_state, rule_updates, pi_stats, payloads, residuals)

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
        deltas = [m - i for m, i in zip(metric_values, self._trainer.log.metric_init)]
        return self._trainer.log.layout.pack(header, deltas, pi_stats)


def batch_size(batch):
    """The number of samples in `batch` (its first element's leading dimension;
    rows for a ragged or sparse one), int64."""
    first = tf.nest.flatten(batch)[0]
    if isinstance(first, tf.RaggedTensor):
        return first.nrows(out_type=tf.int64)
    if isinstance(first, tf.SparseTensor):
        return first.dense_shape[0]
    return tf.shape(first, out_type=tf.int64)[0]
