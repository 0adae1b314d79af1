"""Window scheduling: `ClusterCoordinator` closures of `K` windows of `n_sync` steps.

A window (GPU A-SGD's unit of work) pulls the central variables, runs `n_sync` local steps
on loop tensors and pushes `local_end - local_start` once, scaled on the PS by its
staleness. This module is the chief's side: `WindowTrainer` schedules the windows Keras
asks for `K` at a time per closure (`windows_per_closure`, or about `TARGET_CLOSURE_S` of
work), hands their results to its `window_log.WindowLog` (records, metrics, logs), and runs
each window exactly once. The worker's side is `window`, the PS side of a push `push`, the
results `records`. How
closures are sized and re-runs made safe: docs/architecture.md.
"""

import logging
import time
import weakref

import keras
import numpy as np
import tensorflow as tf

from tf_asgd import internals
from tf_asgd.rules import outer, outer_optimizers, worker_rate
from tf_asgd.runtime import optimizer_options, python_inputs
from tf_asgd.runtime.closure_sizes import (
    MAX_WINDOWS_PER_CLOSURE,
    TARGET_CLOSURE_S,
    ClosureSizes,
    ClosureWaits,
)
from tf_asgd.runtime.commits import PushCommits
from tf_asgd.runtime.push import (
    CentralVariables,
    PushCodec,
    device_of,
    nbytes,
    raw,
    shard_variables,
)
from tf_asgd.runtime.records import WindowRecord
from tf_asgd.runtime.rounds import NoiseSums
from tf_asgd.runtime.window import APPLIED_RING, WindowFunction
from tf_asgd.runtime.window_log import WindowLog

# Re-exported: tests and tools use these from here.
__all__ = [
    "APPLIED_RING",
    "MAX_WINDOWS_PER_CLOSURE",
    "TARGET_CLOSURE_S",
    "CentralVariables",
    "WindowRecord",
    "WindowTrainer",
]

log = logging.getLogger("tf_asgd")

MAX_IN_FLIGHT_PER_WORKER = 2  # closures scheduled but unfinished, per worker


class WindowTrainer:
    """Trains one Keras model with window closures on the workers.

    Built by the strategy's `model_states.ensure_trainer(model)` when the
    Keras hook makes the train function of a model whose strategy is an
    `AsyncParameterServerStrategy`; users do not create it. It holds its
    model by weak reference: the strategy keeps trainers by model, and a
    model that is gone takes its trainer with it. It runs the windows
    (pace, budget, schedule, drain) as its `scheduler` (the strategy's
    `scheduler_type`: asynchronous windows or synchronous rounds) groups
    them; its `log` (a `WindowLog`) records their results, metrics and logs.

    Args:
        model: the Keras model, built and compiled under `strategy.scope()`.
        strategy: the `AsyncParameterServerStrategy` (read: its public options,
            `coordinator`, `counters` and `outer_state(model)`).
        outer_optimizer: what the PS applies to this model's pushes (an
            `OuterSGD` or a `DelayedNesterov`).
        fit_state: what says the running fit's epoch length: an object with
            `steps_per_epoch` (None outside `fit`) and `fit_span`, the
            model's `model_state.ModelState`.
    """

    def __init__(self, model, strategy, outer_optimizer, fit_state):
        self._model = weakref.ref(model)
        self.strategy = strategy
        self.fit_state = fit_state
        self.optimizer = model.optimizer  # a recompiled model gets a new trainer
        self.coordinator = strategy.coordinator
        opt = model.optimizer
        self.push_rule = getattr(opt, "asgd_push_rule", None)
        self.variables = _on_the_ps(
            list(model.trainable_variables) + list(model.non_trainable_variables)
        )
        self.outer = outer_optimizer
        # The workers' rate factor: `lr_scale_peak` after the warm-up, falling toward
        # `lr_scale` (`worker_rate.annealed_rate_scale`).
        self.lr_scale = strategy.worker_rate_scale(opt)
        self.lr_scale_peak = strategy.worker_rate_peak(opt)
        scheduler_type = strategy.scheduler_type
        self.outer_slots = _create_outer_slots(
            model, strategy, outer_optimizer, scheduler_type.round_buffers
        )
        self.moving_average_momenta = _moving_average_momenta(model)
        # Tracked there, so a checkpoint of the model can hold them.
        strategy.outer_state(model).slots = self.outer_slots
        self.noise = NoiseSums(self.outer_slots, strategy.num_workers)
        self.commits = PushCommits(strategy, self.variables)
        self.scheduler = scheduler_type(self)  # before the window, which reads it
        self.window = WindowFunction(self)  # creates the worker-side state
        self.log = WindowLog(model, has_pi=bool(self.push_rule))
        self.sizes = ClosureSizes(strategy, self.log)
        self.waits = ClosureWaits(strategy)  # bounds waits for closures that never end
        self._pending = []  # (RemoteValue, its windows, budget, when scheduled) of closures
        self.iterator = None  # the training data of the running (or last) fit
        self.next_window_id = 0  # the windows given an id so far
        self.windows_taken = 0  # Keras's `train_function` calls that queued their window
        self._epoch_step = 0  # steps asked for this epoch
        self._carried = None  # (metric values, logs) of the last epoch's end
        self.closure_sizes = []  # windows per scheduled closure (first attempts)
        # Per finished closure: (worker, windows asked, windows run, budget s);
        # its windows' records are the `run` last ones of window_log then.
        self.closure_log = []
        self._max_in_flight = MAX_IN_FLIGHT_PER_WORKER * strategy.num_workers
        self._logs, self._logs_at = None, 0.0
        self.bytes_per_pull = nbytes(self.variables, strategy.pull_compression)
        # A push's payload: the update's bytes as they cross (compressed or not).
        self.bytes_per_push = PushCodec(strategy.compression).nbytes(self.variables)
        # One trace for every closure size: the window vectors are padded to
        # MAX_WINDOWS_PER_CLOSURE (a shape that varied would retrace, and TF
        # cannot relax the shape of a function that captures per-worker
        # variables).
        self._window = tf.function(self.window.run, autograph=False)
        self._concrete = None  # (iterator, the concrete function scheduled with it)
        self._fed_concrete = {}  # element spec -> the closure on batches the chief sends

    @property
    def model(self):
        """The Keras model trained (None once it is gone)."""
        return self._model()

    @property
    def window_log(self):
        """A `WindowRecord` per finished window, in the order seen."""
        return self.log.records

    @property
    def lr_warmup_steps(self):
        """Steps over which the workers' rate rises to `lr_scale_peak` at the start
        of each `fit`: a share of the running (or last) fit's steps, at most Adam's
        untuned warm-up (`worker_rate.worker_rate_warmup_steps`)."""
        return _warmup_steps(self, self.fit_state)

    @property
    def fit_step_span(self):
        """`(first, last)`: the running (or last) fit's global optimizer steps (every
        worker's); the factor warms up from `first`."""
        return _fit_steps(self, self.fit_state)

    def stats(self):
        """The strategy's push counters, with this model's byte counts (an `AsyncStats`)."""
        gain = outer_optimizers.outer_gain(self.outer, self.strategy.num_workers)
        stats = self.strategy.counters.stats(
            self.bytes_per_pull, self.bytes_per_push, self.log.samples_per_window, gain
        )
        stats.noise_scale, stats.noise_scale_rounds = self.noise.value, self.noise.rounds
        _state_workers_rate(self, stats)
        return stats

    # ---- chief side -------------------------------------------------------

    def train_function(self, iterator):
        """Keras's `train_function`: one window of `n_sync` steps.

        The window is queued and scheduled with others, `K` to a closure
        (`windows_per_closure`). It returns at once while fewer than
        `MAX_IN_FLIGHT_PER_WORKER` closures per worker are unfinished, else
        once one finishes: enough queued to keep every worker busy, few
        enough that the progress bar follows the training and a stop waits
        for seconds, not an epoch. Outside `fit` (no epoch) the window is
        scheduled at once, alone.
        """
        self.iterator = iterator
        scheduler = self.scheduler
        scheduler.before_window()
        self.windows_taken += 1  # this call's window is queued below (`ps_recovery`)
        window_id = scheduler.next_id()
        # An epoch is exactly its steps: its last window may be shorter.
        n_sync = self.strategy.n_sync
        steps = self.fit_state.steps_per_epoch
        if self._epoch_step == 0:  # before an epoch's first window is queued
            optimizer_options.check_window_steps(self.model.optimizer, n_sync, steps)
            scheduler.begin_epoch(window_id, steps)
        num_steps = n_sync if not steps else max(1, min(n_sync, steps - self._epoch_step))
        if python_inputs.is_feed(iterator):  # Python-side data: the chief reads the batches
            num_steps = iterator.read(window_id, num_steps)  # fewer where the data ends
            if iterator.ran_out:  # a generator ran out: Keras stops training
                self.model.stop_training = True
            if not num_steps:
                return self._logs if self._logs is not None else {}
        self._epoch_step += num_steps
        left = -(-(steps - self._epoch_step) // n_sync) if steps else 0  # windows still to come
        scheduler.add(num_steps, window_id, steps, left)
        # The epoch's last window: its logs are the epoch's, as in Keras (the
        # epoch's end waits for these windows anyway, unless `epoch_barrier=False`).
        last = bool(steps) and left <= 0
        waits = last and scheduler.epoch_end_waits()
        self.drain(block=True, keep=0 if waits else self._max_in_flight)
        # Progress for callbacks, refreshed a few times a second at most: the
        # chief's time per window bounds throughput at small n_sync.
        now = time.perf_counter()
        if self._logs is None or now - self._logs_at > 0.25 or last:
            self.drain(block=False)
            # No window of the epoch finished: no metric yet, and no logs
            # (a progress bar shows whatever it is given, zeros included).
            self._logs = self.log.logs() if self.log.epoch_records else {}
            self._logs_at = now
        return self._logs

    def last_step(self):
        """The index of the epoch's last step asked for so far (0 before any):
        what Keras's batch-level callbacks get as `batch`. Keras's own index
        runs on to the next multiple of `n_sync`, past an epoch whose last
        window is shorter."""
        return max(self._epoch_step, 1) - 1

    def schedule(self, windows, first=True):
        """Schedules `windows` (`[(steps, id)]`) as one closure on any worker (`first`:
        their first attempt, counted in `closure_sizes`)."""
        # Two small tensors: each argument costs the chief a conversion.
        plan = np.zeros([2, MAX_WINDOWS_PER_CLOSURE], np.int64)  # [ids, steps]
        plan[0] = -1
        plan[1, : len(windows)], plan[0, : len(windows)] = zip(*windows)
        budget = self.sizes.budget(len(windows))
        if python_inputs.is_feed(self.iterator):
            function, args, windows = self._fed_closure(windows, plan, budget)
            if not windows:
                return
        else:
            sharded = self.strategy.training_data.is_sharded(self.iterator)
            limits = closure_limits(self, windows, budget, sharded)
            args = (self.iterator, tf.constant(plan), limits)
            if self._concrete is None or self._concrete[0] is not self.iterator:
                self.window.prepare(self.iterator)  # errors before anything is traced
                self._concrete = (
                    self.iterator,
                    internals.concrete_function_for(self._window, args),
                )
            function = self._concrete[1]
        try:
            rv = self.coordinator.schedule(function, args=args)
        except Exception:  # a PS's loss, raised at the next schedule: `abandon` finds them
            self.scheduler.requeue(windows)
            raise
        self._pending.append((rv, windows, budget, time.monotonic()))
        if first:
            self.closure_sizes.append(len(windows))

    def _fed_closure(self, windows, plan, budget):
        """`(concrete function, args, windows)` of a closure of `windows` on
        batches the chief read (`python_inputs.ChiefFeed`): they travel as its
        first argument. Windows of an earlier, failed fit (whose batches are
        gone) are dropped from `windows`."""
        feed = self.iterator
        if not all(feed.holds(w) for _, w in windows):
            windows = [(n, w) for n, w in windows if feed.holds(w)]
            if not windows:
                return None, None, windows
            plan = np.zeros_like(plan)
            plan[0] = -1
            plan[1, : len(windows)], plan[0, : len(windows)] = zip(*windows)
        args = (
            feed.pack([w for _, w in windows]),
            tf.constant(plan),
            closure_limits(self, windows, budget),
        )
        concrete = self._fed_concrete.get(feed.key)
        if concrete is None:
            self.window.prepare(None, feed.element_spec)  # errors before anything is traced
            function = python_inputs.window_on_sent_batches(self.window, feed.element_spec)
            concrete = self._fed_concrete[feed.key] = function.get_concrete_function(
                feed.signature,
                tf.TensorSpec(plan.shape, tf.int64),
                tf.TensorSpec([LIMITS], tf.float64),
            )
        return concrete, args, windows

    def drain(self, block, keep=0):
        """Records finished closures' windows in the order they finish; with
        `block`, waits until at most `keep` closures are unfinished. Windows a
        closure did not start (its budget ran out) are scheduled again.

        Any finished closure frees a slot, not only the oldest: waiting for
        the oldest would hold every fast worker behind a straggler's closure.
        """
        while True:
            ready = [p for p in self._pending if internals.remote_value_ready(p[0])]
            for item in ready:
                rv, windows, budget, _ = item
                try:  # a failed closure stays pending: `abandon` or `drop_failed` takes it
                    rows = np.asarray(rv.fetch()).reshape(-1, self.log.layout.size)
                except tf.errors.UnavailableError:
                    if internals.remote_value_failed(rv):
                        raise
                    self._pending.remove(item)
                    self._result_lost(windows)
                    continue
                self._pending.remove(item)
                self.waits.finished(int(rows[0][0]))
                for row, (steps, window_id) in zip(rows, windows):
                    self.log.record(row, window_id, steps)
                if python_inputs.is_feed(self.iterator):
                    self.iterator.release([w for _, w in windows[: len(rows)]])
                self.closure_log.append((int(rows[0][0]), len(windows), len(rows), budget))
                if len(rows) < len(windows):
                    self.schedule(windows[len(rows) :], first=False)
            if not block or len(self._pending) <= keep:
                return
            self.waits.check([(at, budget) for _, _, budget, at in self._pending])
            internals.wait_briefly(self._pending[0][0])

    def _result_lost(self, windows):
        """A closure finished, but its result was lost with its worker before
        the chief fetched it. Its windows run again: each that had pushed is a
        replay (it pushes nothing), the others train as scheduled."""
        log.warning(
            "A finished closure's result was lost with its worker; its %d window(s) run "
            "again (those that had pushed as replays, which push nothing).",
            len(windows),
        )
        self.schedule(windows, first=False)

    def logs_so_far(self):
        """The logs `train_function` last returned (`{}` before any)."""
        return self._logs if self._logs is not None else {}

    def quiesce(self):
        """Waits until every scheduled window has finished: no push is then half applied
        (a PS snapshot's moment, `ps_recovery`). Queued windows stay queued: they have not
        started. Asynchronous only."""
        self.drain(block=True)

    def abandon(self):
        """Forgets every queued and scheduled window (a PS's loss failed them) and the
        traces that captured the old PS variables; returns the windows, `(steps, id)`."""
        windows = [w for _, ws, *_ in self._pending for w in ws] + self.scheduler.take_queued()
        self._pending = []
        self._concrete, self._fed_concrete = None, {}
        return windows

    def rebuild_input(self):
        """Each worker's training iterator anew, after a PS's loss cancelled reads of it
        (`internals.rebuild_per_worker_iterator`); under `AutoShardPolicy.OFF` each worker
        skips its offset again. Batches the chief sends need nothing."""
        if self.iterator is not None and not python_inputs.is_feed(self.iterator):
            internals.rebuild_per_worker_iterator(self.strategy.coordinator, self.iterator)
            self.window.state.forget_data_shift()

    def retrain(self, windows):
        """Trains `windows` (`(steps or None, id)`: rolled back, or lost in flight) again
        as they first ran (`scheduler.retrain`)."""
        self.scheduler.retrain(windows)

    def finish_fit(self):
        """At `fit`'s end: trains what a recovery in the last epoch's callbacks queued
        again (`retrain`), then waits for every window, those an epoch's end left running
        (`epoch_barrier=False`) included."""
        self.scheduler.flush()
        self.drain(block=True)

    def drop_failed(self):
        """Forgets the scheduled closures that failed (after a failed `fit`,
        once they are all finished): their windows are not recorded, and the
        next `fit` does not raise their errors again."""
        self._pending = [p for p in self._pending if not internals.remote_value_failed(p[0])]

    def reset_metrics(self):
        """Starts an epoch's metrics from the model's (just reset) metric variables."""
        self.log.reset_metrics()
        self._epoch_step = 0
        self._logs = None
        self.scheduler.start_epoch()

    def finish(self):
        """The epoch's end: waits for every scheduled window (or, without the
        epoch's barrier, schedules the queued ones and waits for none); writes
        the epoch's metrics back.

        Raises if every window of the epoch held NaN/Inf: training cannot
        progress, and spinning on would hide it.
        """
        waits = self.scheduler.epoch_end_waits()
        self.scheduler.end_epoch()
        self.drain(block=False)
        # No window of the epoch finished yet (`epoch_barrier=False`): its metrics are the
        # last ones finished; the fit's first epoch waits for one.
        carried = None if waits or self.log.epoch_records else self._carried
        while not waits and carried is None and not self.log.epoch_records and self._pending:
            self.drain(block=True, keep=len(self._pending) - 1)
        while waits:
            self.drain(block=True)  # bounded (`ClosureWaits`); then join has none left
            self.coordinator.join()
            self.drain(block=True)  # may schedule windows a closure did not run
            if not self._pending:
                break
        self.scheduler.close_epoch()
        self._epoch_step = 0
        # (Unless a callback stopped training, e.g. TerminateOnNaN: Keras then
        # ends `fit` as it would.)
        if not self.model.stop_training:
            self.log.check_progress()
        values, logs = carried or (self.log.metric_values(), self.log.logs())
        self._carried = (values, logs)
        for var, value in zip(self.model.metrics_variables, values):
            var.assign(value)
        self.fit_state.epochs_left -= 1
        return {**logs, **self.stats().as_logs()}


def _on_the_ps(variables):
    """`variables`, once each is found on a parameter server (else `ValueError`)."""
    for v in variables:
        device = device_of(raw(v))
        if "/job:ps" not in device:
            raise ValueError(
                f"Variable {v.path!r} lives on {device or 'the chief'}, "
                "not on a parameter server: the model was built outside "
                "`AsyncParameterServerStrategy.scope()`. Create and compile "
                "the model inside `with strategy.scope():`."
            )
    return variables


def _warmup_steps(trainer, state):
    """`WindowTrainer.lr_warmup_steps`, with `state` its fit state (a `ModelState`): a
    share of the fit's steps, at most Adam's untuned warm-up for Adam's kin."""
    beta_2 = optimizer_options.second_moment_beta(trainer.optimizer)
    return worker_rate.worker_rate_warmup_steps(
        trainer.lr_scale_peak,
        trainer.lr_scale,
        state.fit_span[1],
        worker_rate.untuned_warmup_steps(beta_2),
    )


def _fit_steps(trainer, state):
    """`WindowTrainer.fit_step_span`, with `state` its fit state (a `ModelState`)."""
    start, steps = state.fit_span
    if start is None:  # read once a fit, inside it: a PS lost meanwhile is recovered
        start = int(internals.iteration_variable(trainer.optimizer).numpy())
        state.fit_span = (start, steps)
        _say_workers_rate(trainer, start, steps)
    return float(start), float(start + steps)


def _say_workers_rate(trainer, start, steps):
    """Logs, once a fit, the learning rate the workers' local steps run at."""
    peak, final = trainer.lr_scale_peak, trainer.lr_scale
    if peak == final == 1.0:
        log.info(
            "tf_asgd: workers' learning rate: the optimizer's own (lr_scaling=%r).",
            trainer.strategy.lr_scaling,
        )
        return
    shape = f"x{peak:g}"
    if peak != final:
        end = _factor(trainer, steps - 1)
        shape += f", then falling as 1/t toward x{final:g} (x{end:.3g} at this fit's end)"
    elif internals.has_rate_schedule(trainer.optimizer):
        shape += ", kept on the optimizer's schedule (which lowers the rate itself)"
    log.warning(
        "tf_asgd: workers' learning rate: the optimizer's rate times a factor rising "
        "from 1 over this fit's first %d steps to %s (global steps %d to %d; "
        "lr_scaling=%r; logged as 'workers_learning_rate').",
        trainer.lr_warmup_steps,
        shape,
        start,
        start + steps,
        trainer.strategy.lr_scaling,
    )


def _factor(trainer, step):
    """The workers' factor at `step` of the running (or last) fit."""
    return float(
        worker_rate.annealed_rate_scale(
            trainer.lr_scale_peak, trainer.lr_scale, step, trainer.lr_warmup_steps
        )
    )


def _state_workers_rate(trainer, stats):
    """Fills in `stats` (an `AsyncStats`) what the workers' rate is: its factors, its
    warm-up, the factor at the running or last `fit`'s end, the rate now, and whether
    the local optimizer counts its own steps."""
    first, last = trainer.fit_step_span
    stats.lr_scale, stats.lr_scale_peak = trainer.lr_scale, trainer.lr_scale_peak
    stats.lr_warmup_steps = trainer.lr_warmup_steps
    stats.lr_scale_end = _factor(trainer, max(0, int(last - first) - 1))
    stats.workers_learning_rate = workers_learning_rate(trainer)
    stats.local_steps_own = trainer.window.state.local_steps_own


def workers_learning_rate(trainer):
    """The rate the workers' local steps run at now: the optimizer's at the global step
    count, times the factor (for `History` and TensorBoard: `workers_learning_rate`)."""
    optimizer = trainer.optimizer
    step = int(internals.iteration_variable(optimizer).numpy())
    first, _ = trainer.fit_step_span
    try:
        rate = float(optimizer.learning_rate)
    except (AttributeError, TypeError, ValueError):  # an optimizer without one rate
        return float("nan")
    return rate * _factor(trainer, step - first)


LIMITS = 5  # the entries of a closure's `limits` (`closure_limits`)


def closure_limits(trainer, windows, budget, sharded=False):
    """A closure's `limits` (`WindowFunction.run`): its windows, its budget in seconds,
    the running fit's first global step, its warm-up steps, and 1 where each worker
    reads all the data and starts at its own offset (0 where it reads its shard:
    `sharded`)."""
    first, _ = trainer.fit_step_span
    offset = not sharded
    return tf.constant([len(windows), budget, first, trainer.lr_warmup_steps, offset], tf.float64)


def _create_outer_slots(model, strategy, opt, round_buffers):
    """The outer optimizer's state per variable and PS shard, beside it
    (`outer.create_slots`; with a round's buffer and noise sums where `round_buffers`);
    non-trainable variables (e.g. moving statistics) get none."""
    n_train = len(model.trainable_variables)
    variables = list(model.trainable_variables) + list(model.non_trainable_variables)
    with strategy.scope():
        return [
            [
                outer.create_slots(opt, shard, round_buffers) if i < n_train else {}
                for shard in shard_variables(raw(v))
            ]
            for i, v in enumerate(variables)
        ]


def _moving_average_momenta(model):
    """Per variable of `WindowTrainer.variables`, the momentum of the BatchNormalization
    moving average it is (its push: `outer_optimizers.moving_average_push`), else None."""
    momenta = {}
    for layer in internals.all_layers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            for v in (layer.moving_mean, layer.moving_variance):
                momenta[id(v)] = float(layer.momentum)
    variables = list(model.trainable_variables) + list(model.non_trainable_variables)
    return [momenta.get(id(v)) for v in variables]


def validate_windows_per_closure(value):
    """Raises unless `value` is None (automatic) or an int in
    `[1, MAX_WINDOWS_PER_CLOSURE]` (the `windows_per_closure` argument)."""
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or not (1 <= value <= MAX_WINDOWS_PER_CLOSURE)
    ):
        raise ValueError(
            "windows_per_closure must be None (automatic: about "
            f"{TARGET_CLOSURE_S * 1000:.0f} ms of windows per closure) or an integer from 1 "
            f"to {MAX_WINDOWS_PER_CLOSURE}, got {value!r}."
        )
