"""Distributed evaluation: `evaluate` and `fit`'s validation sharded over the workers.

With `AsyncParameterServerStrategy(evaluation="workers")` (the default), `evaluate` is split
into shards of whole batches, one closure per shard; each runs the model's `test_step`
statelessly against the central variables and returns its metric states, which the chief
adds (`Evaluator`). The result is exact: the batches are Keras's, each in one shard. What
the workers cannot evaluate exactly runs on the chief (Keras's own loop), with a log line
saying why. How shards are made and read: docs/architecture.md.
"""

import logging
import time
import weakref

import keras
import numpy as np
import tensorflow as tf
from keras import StatelessScope

from tf_asgd import errors, internals
from tf_asgd.keras_glue import keras_hook
from tf_asgd.runtime import closure_sizes, metric_states
from tf_asgd.runtime.push import raw, read

EVALUATION_MODES = ("workers", "chief")
SHARDS_PER_WORKER = 4  # array shards per worker: a slow worker holds back a quarter of its share
DATASET_SHARDS_PER_WORKER = 2  # fewer for datasets: each shard skips the batches before it
BUDGET_FACTOR = closure_sizes.BUDGET_FACTOR  # a shard's share of the bound on waiting
FETCH_RETRIES = 3  # a shard whose result was lost with its worker runs again, at most this often
_EXTERNAL_STATE_WARN = 0  # DatasetToGraphV2's ExternalStatePolicy.WARN

log = logging.getLogger("tf_asgd")


def validate_evaluation(value):
    """Raises `ValueError` unless `value` is one of `EVALUATION_MODES`."""
    if value not in EVALUATION_MODES:
        raise ValueError(
            f"evaluation must be 'workers' (evaluate and fit's validation sharded over "
            f"the workers) or 'chief' (Keras's loop on the chief), got {value!r}."
        )


def _as_array(value):
    """A dense NumPy array of numbers or booleans for an array input, with
    floats in Keras's `floatx` as Keras's array adapter makes them, or None."""
    try:
        array = np.asarray(value)
    except Exception:  # ragged and other inputs NumPy cannot take
        return None
    if array.dtype.kind not in "biuf" or array.ndim == 0:
        return None
    if array.dtype.kind == "f" and array.dtype != np.dtype(keras.backend.floatx()):
        array = array.astype(keras.backend.floatx())
    return array


class Evaluator:
    """Evaluates one model on the workers (built by the strategy, per model).

    Holds the model weakly and the traced shard functions it made (one per
    array structure and batch size, and one for the last dataset evaluated).
    """

    def __init__(self, model, strategy):
        self._model = weakref.ref(model)
        self.strategy = strategy
        # Traced shard functions, for the model as compiled when `_built` was set:
        self._functions = {}  # arrays: (structure, specs, batch size) -> tf.function
        self._dataset = None  # (weakref to the last dataset, its tf.function)
        self._said = set()  # reasons already logged
        self._built = None  # weakref to the loss tracker of the compile last built for
        self._mergeable = None  # (data spec, metric_states.unmergeable) for the compile built
        self.last_shards = []  # (first batch, batches) of the last evaluation's shards

    @property
    def model(self):
        return self._model()

    # ---- the chief's side ---------------------------------------------------

    def evaluate(
        self,
        x=None,
        y=None,
        batch_size=None,
        verbose="auto",
        sample_weight=None,
        steps=None,
        callbacks=None,
        return_dict=False,
    ):
        """Keras's `evaluate` on the workers. Returns `(True, result)`, or
        `(False, None)` when the chief must evaluate (the reason is logged)."""
        model = self.model
        plan, why = self._plan(x, y, sample_weight, batch_size, steps)
        if why is None:
            why = self._model_reason(model, plan)
        if why is not None:
            self._say(why)
            return False, None
        init = self._reset_metrics(model)
        num_batches = plan["num_batches"]
        if not isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks = keras.callbacks.CallbackList(
                callbacks,
                add_progbar=verbose != 0,
                verbose=verbose,
                epochs=1,
                steps=num_batches,
                model=model,
            )
        model.stop_evaluating = False
        callbacks.on_test_begin()
        total = [np.zeros(np.shape(v), np.float64) for v in init]
        done = 0
        for delta, count in self._run_shards(plan, init):
            total = [t + d for t, d in zip(total, delta)]
            if count:  # (0: a shard past the end of a dataset of unknown length)
                callbacks.on_test_batch_begin(done)
                done += count
                callbacks.on_test_batch_end(done - 1, _results(model, init, total))
        for var, value, t in zip(model.metrics_variables, init, total):
            var.assign((value + t).astype(var.dtype))
        logs = internals.pythonify_logs(model.get_metrics_result())
        callbacks.on_test_end(logs)
        if return_dict:
            return True, logs
        return True, internals.flatten_metrics_in_order(model, logs)

    def _say(self, why):
        if why not in self._said:
            self._said.add(why)
            log.warning("tf_asgd: evaluating on the chief: %s", why)

    def _plan(self, x, y, sample_weight, batch_size, steps):
        """What to evaluate: `(plan, None)`, or `(None, why the chief must)`."""
        if isinstance(x, tf.data.Dataset):
            if y is not None or sample_weight is not None:
                return None, "a dataset with separate y or sample_weight (Keras refuses it)"
            seen = self._dataset is not None and self._dataset[0]() is x
            what = None if seen else keras_hook.python_ops_in(x)  # (serializes the dataset)
            if what is not None:
                return None, f"the evaluation data is {what}"
            n = int(x.cardinality())
            if n >= 0 and steps is not None:
                n = min(n, steps)
            elif n < 0 and steps is not None:  # infinite, or unknown: shards stop at its end
                n = steps
            if n < 0:
                return None, (
                    "the evaluation dataset's length is "
                    + ("infinite" if n == tf.data.INFINITE_CARDINALITY else "unknown")
                    + " and no `steps` was given"
                )
            return dict(kind="dataset", dataset=x, num_batches=n), None
        if x is None or not internals.is_array_input(x, y, sample_weight):
            return None, (
                f"the evaluation data is a {type(x).__name__} (read by Python on the chief)"
            )
        data = tuple(
            None if d is None else tf.nest.map_structure(_as_array, d)
            for d in (x, y, sample_weight)
        )
        while data and data[-1] is None:
            data = data[:-1]
        if any(d is None for d in data):
            return None, "sample_weight without y"
        flat = tf.nest.flatten(data)
        if any(a is None for a in flat):
            return None, "arrays that are not dense numbers (sparse, ragged, strings, objects)"
        rows = {len(a) for a in flat}
        if len(rows) != 1:
            return None, "arrays of different lengths (Keras will say which)"
        n, batch_size = rows.pop(), batch_size or 32
        num_batches = -(-n // batch_size)
        if steps is not None:
            num_batches = min(num_batches, steps)
        return dict(
            kind="arrays",
            data=data,
            flat=flat,
            rows=n,
            batch_size=batch_size,
            num_batches=num_batches,
        ), None

    def _model_reason(self, model, plan):
        """Why the chief must evaluate `model` (None: the workers can). Builds
        the model and its compiled metrics from a first batch, as Keras does."""
        if type(model).test_step is not internals.TensorFlowTrainer.test_step:
            return (
                f"model {model.name!r} overrides test_step (its logs need not come from "
                "metrics that merge over shards)"
            )
        if model.run_eagerly:
            return "the model runs eagerly (run_eagerly=True)"
        if plan["num_batches"] == 0:
            return "no batch to evaluate"
        tracker = internals.loss_tracker(model)  # compile makes a new one
        if self._built is None or self._built() is not tracker or not model.built:
            # First use, or compiled again: build the model and its metrics as
            # Keras would; functions traced for another compile are stale.
            self._functions, self._dataset, self._mergeable = {}, None, None
            model._maybe_symbolic_build(data_batch=self._first_batch(plan))
            self._built = weakref.ref(internals.loss_tracker(model))
        found = self._unmergeable(model, plan)
        return metric_states.describe(found) if found else None

    def _unmergeable(self, model, plan):
        """`metric_states.unmergeable` for the model's `test_step` on the
        plan's data (traced once per compile and data structure)."""
        if plan["kind"] == "dataset":
            spec = plan["dataset"].element_spec
        else:
            spec = tf.nest.map_structure(
                lambda a: tf.TensorSpec([None] + list(a.shape[1:]), tf.as_dtype(a.dtype)),
                self._first_batch(plan),
            )
        key = repr(spec)
        if self._mergeable is None or self._mergeable[0] != key:
            variables = list(model.trainable_variables) + list(model.non_trainable_variables)

            def update(args, states):
                return _test_step_states(model, variables, args[1], args[0], states)

            weights = [tf.TensorSpec(v.shape, v.dtype) for v in variables]
            self._mergeable = (key, metric_states.unmergeable(model, update, (spec, weights)))
        return self._mergeable[1]

    def _first_batch(self, plan):
        if plan["kind"] == "dataset":
            return next(iter(plan["dataset"]))
        first = tf.nest.map_structure(lambda a: a[: plan["batch_size"]], plan["data"])
        return first if len(first) > 1 else first[0]

    def _reset_metrics(self, model):
        """Resets the model's metrics (as evaluate does, not the window
        trainer's epoch) and returns their values, the state every shard
        starts from."""
        with keras_hook.local_mode():
            model.reset_metrics()
        return [np.asarray(v.numpy(), np.float64) for v in model.metrics_variables]

    def _shards(self, plan):
        """`(first batch, batches)` of each shard: fixed-size runs of batches."""
        per_worker = DATASET_SHARDS_PER_WORKER if plan["kind"] == "dataset" else SHARDS_PER_WORKER
        n = plan["num_batches"]
        size = max(1, -(-n // (per_worker * self.strategy.num_workers)))
        return [(start, min(size, n - start)) for start in range(0, n, size)]

    def _run_shards(self, plan, init):
        """Schedules a closure per shard; yields `(state deltas, batches)` of
        each as it finishes (in the order they finish). A worker that holds a
        shard and neither finishes nor fails it (a frozen process) stops the
        wait once no shard has finished for `connect_timeout` plus four times the
        longest shard so far (`closure_sizes.ClosureWaits`)."""
        function = self._function_for(plan, init)
        self.last_shards = shards = self._shards(plan)
        coordinator = self.strategy.coordinator
        waits = closure_sizes.ClosureWaits(self.strategy, during="evaluate")
        pending, longest = [], None
        try:
            for start, count in shards:
                if plan["kind"] == "dataset":
                    args = (tf.constant(start, tf.int64), tf.constant(count, tf.int64))
                else:
                    b = plan["batch_size"]
                    lo, hi = start * b, min((start + count) * b, plan["rows"])
                    # Tensors on the chief now: a NumPy argument is converted when the
                    # closure runs, under its worker's device, a copy that holds the GIL
                    # (a frozen worker would stop every thread of the chief).
                    args = (tuple(tf.constant(a[lo:hi]) for a in plan["flat"]),)
                scheduled = coordinator.schedule(function, args=args)
                pending.append((scheduled, args, 0, time.monotonic()))
            while pending:
                ready = [p for p in pending if internals.remote_value_ready(p[0])]
                if not ready:
                    internals.wait_briefly(pending[0][0], 0.005)
                    budget = 1e9 if longest is None else BUDGET_FACTOR * longest
                    waits.check([(at, budget) for *_, at in pending])
                    continue
                for item in ready:
                    pending.remove(item)
                    value, args, retries, at = item
                    try:
                        flat = value.fetch()
                    except tf.errors.UnavailableError:
                        # The shard ran, but the worker holding its result died before the
                        # chief copied it: the shard is read-only, so it runs again.
                        if retries >= FETCH_RETRIES:
                            raise
                        value = coordinator.schedule(function, args=args)
                        pending.append((value, args, retries + 1, time.monotonic()))
                        continue
                    deltas, batches, worker = _unpack(flat, init)
                    waits.finished(worker)
                    longest = max(longest or 0.0, time.monotonic() - at)
                    yield deltas, batches
        except KeyboardInterrupt:
            pending = []
            keras_hook.wait_after_interrupt(coordinator)
            raise
        except errors.WorkerStalledError:
            pending = []  # the frozen worker's shard may never end: no join (read-only)
            raise
        finally:
            if pending:  # an error: nothing may be left running
                try:
                    coordinator.join()
                except Exception:  # the first error is on its way
                    pass

    # ---- the worker's side --------------------------------------------------

    def _function_for(self, plan, init):
        """The traced shard function for `plan` (made once per array structure
        and batch size, or per dataset)."""
        if plan["kind"] == "dataset":
            dataset = plan["dataset"]
            if self._dataset is not None and self._dataset[0]() is dataset:
                return self._dataset[1]
            function = _dataset_function(self._model, dataset, init)
            self._dataset = (weakref.ref(dataset), function)
            return function
        specs = tuple(
            tf.TensorSpec([None] + list(a.shape[1:]), tf.as_dtype(a.dtype)) for a in plan["flat"]
        )
        key = (repr(tf.nest.map_structure(lambda _: 0, plan["data"])), specs, plan["batch_size"])
        if key not in self._functions:
            self._functions[key] = _array_function(self._model, plan, specs, init)
        return self._functions[key]


def _array_function(model_ref, plan, specs, init):
    """The traced shard function of array data shaped as `plan`'s: it takes
    the shard's rows (`specs`) and runs its batches of `plan['batch_size']`."""
    structure, b = plan["data"], plan["batch_size"]

    def shard(flat):
        data = tf.nest.pack_sequence_as(structure, list(flat))
        rows = tf.shape(flat[0])[0]
        batches = (rows + b - 1) // b

        def batch(i):
            lo = i * b
            part = tf.nest.map_structure(lambda t: t[lo : tf.minimum(lo + b, rows)], data)
            return part if len(part) > 1 else part[0]

        return _states(model_ref, batches, batch, init)

    return tf.function(shard, input_signature=[specs], autograph=False)


def _dataset_function(model_ref, dataset, init):
    """The traced shard function of `dataset`: it takes `(start, count)` and
    runs the dataset's batches `start` to `start + count` (its graph travels
    to the worker with the function)."""
    graph = tf.raw_ops.DatasetToGraphV2(
        input_dataset=tf.data.experimental.to_variant(dataset),
        external_state_policy=_EXTERNAL_STATE_WARN,
        strip_device_assignment=True,
    ).numpy()
    spec = dataset.element_spec

    def shard(start, count):
        # The graph is a constant of the function (sent to a worker once),
        # joined with an empty string made from `start`: a dataset built
        # from a constant alone is constant-folded into a variant tensor,
        # which cannot travel to the worker ("Cannot parse tensor from proto").
        empty = tf.strings.substr(tf.strings.as_string(start), 0, 0)
        graph_def = tf.strings.join([empty, tf.constant(graph)])
        source = tf.data.experimental.from_variant(
            tf.raw_ops.DatasetFromGraph(graph_def=graph_def), spec
        )
        iterator = iter(source.skip(start).take(count))
        return _states(
            model_ref,
            tf.cast(count, tf.int32),
            lambda i: iterator.get_next_as_optional(),
            init,
            optional=True,
        )

    return tf.function(shard, autograph=False)


def _states(model_ref, num_batches, batch, init, optional=False):
    """On the worker: the model's (`model_ref()`) `test_step` over
    `num_batches` batches (`batch(i)`; with `optional`, a
    `tf.experimental.Optional` of one, and the loop stops early at the data's
    end), from the central variables read once. Returns the metric-variable
    states minus `init`, flat, float64, then the number of batches read and
    the worker's index."""
    model = model_ref()  # at trace time: the traced function holds no model
    variables = list(model.trainable_variables) + list(model.non_trainable_variables)
    weights = [read(raw(v)) for v in variables]
    metric_vars = model.metrics_variables
    states = [tf.constant(v.astype(m.dtype)) for v, m in zip(init, metric_vars)]

    def step(data, states):
        return _test_step_states(model, variables, weights, data, states)

    # The step runs in the loop's body, never under a `tf.cond`: a lookup
    # table made under the strategy's scope is the worker's own through a
    # call-time capture, which `tf.while_loop` passes in and `tf.cond` drops
    # (its placeholder would be left unfed on the worker).
    if optional:  # the next batch is read ahead: its Optional says whether to go on
        out = tf.while_loop(
            lambda i, value, *_: tf.logical_and(i < num_batches, value.has_value()),
            lambda i, value, *states: (i + 1, batch(i + 1), *step(value.get_value(), states)),
            (tf.constant(0), batch(0), *states),
            parallel_iterations=1,
        )
    else:
        out = tf.while_loop(
            lambda i, value, *_: i < num_batches,
            lambda i, value, *states: (i + 1, value, *step(batch(i), states)),
            (tf.constant(0), tf.constant(0), *states),
            parallel_iterations=1,
        )
    worker = tf.distribute.coordinator.experimental_get_current_worker_index()
    return tf.concat(
        [tf.reshape(tf.cast(s, tf.float64) - v, [-1]) for s, v in zip(out[2:], init)]
        + [tf.cast(out[:1], tf.float64), tf.cast([worker], tf.float64)],
        axis=0,
    )


def _unpack(flat, init):
    """`(state deltas, batches read, worker index)` of a shard's result."""
    flat, out, at = np.asarray(flat), [], 0
    for value in init:
        size = int(np.prod(np.shape(value)))
        out.append(flat[at : at + size].reshape(np.shape(value)))
        at += size
    return out, int(flat[at]), int(flat[at + 1])


def _results(model, init, total):
    """The model's metric results for metric-variable values `init + total`."""
    values = [i + t for i, t in zip(init, total)]
    mapping = [(v, tf.constant(x.astype(v.dtype))) for v, x in zip(model.metrics_variables, values)]
    with StatelessScope(state_mapping=mapping):
        return internals.pythonify_logs(model.get_metrics_result())


def _test_step_states(model, variables, weights, data, states):
    """The metric states after the model's `test_step` on `data`, run under
    a `keras.StatelessScope` that maps `variables` to `weights` and the
    metric variables to `states`. The scope collects `add_loss` terms, as a
    forward pass outside a scope keeps them, so that `compute_loss` counts
    them as Keras's evaluation on the chief does."""
    metric_vars = model.metrics_variables
    mapping = list(zip(variables, weights)) + list(zip(metric_vars, states))
    with StatelessScope(state_mapping=mapping, collect_losses=True) as scope:
        model.test_step(data)
    new = [scope.get_current_value(v) for v in metric_vars]
    return [s if n is None else tf.cast(n, s.dtype) for s, n in zip(states, new)]
