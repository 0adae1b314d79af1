"""The narrow hook into Keras 3's TensorFlow trainer.

Keras 3 has no parameter-server path. `install()` wraps a few methods of Keras's
`TensorFlowTrainer` (reached through `internals`); each wrapper runs the original
unchanged unless the model's strategy is an `AsyncParameterServerStrategy`, which it
recognises by the marker attribute `_is_tf_asgd_strategy` without importing it, and whose
per-model state it reads through `strategy.model_states`. For such models `fit` drives
windows, `evaluate` runs sharded on the workers (or on the chief), `predict` runs on the
chief, and what a window cannot honour is refused before any window. Nothing is stored on
the user's model. Each wrapped method: docs/architecture.md.
"""

import collections.abc
import contextlib
import functools
import inspect
import logging
import threading
import types
import weakref

import keras
import tensorflow as tf

from tf_asgd import errors, internals
from tf_asgd.cluster import lost_tasks
from tf_asgd.runtime import (
    constraints,
    input_sharding,
    optimizer_options,
    ps_recovery,
    python_inputs,
)

SUPPORTED_KERAS = internals.SUPPORTED_KERAS

_installed = False
_thread = threading.local()  # local-mode depth, per thread
log = logging.getLogger("tf_asgd")


def _asgd_strategy(strategy):
    """`strategy` if it is an `AsyncParameterServerStrategy` (by its marker), else None."""
    return strategy if getattr(strategy, "_is_tf_asgd_strategy", False) else None


def _strategy_of(model):
    """The `AsyncParameterServerStrategy` `model` was created under, or None."""
    return _asgd_strategy(internals.model_strategy(model))


def _ours(model):
    return _strategy_of(model) is not None


def in_local_mode():
    """True while Keras should see plain local datasets (evaluate, predict, build)."""
    return getattr(_thread, "depth", 0) > 0


@contextlib.contextmanager
def local_mode():
    _thread.depth = getattr(_thread, "depth", 0) + 1
    try:
        yield
    finally:
        _thread.depth -= 1


def _window_trainer(model):
    """The model's `WindowTrainer`, built by its strategy on first use."""
    return _strategy_of(model).model_states.ensure_trainer(model)


def _fitting_state(model):
    """The model's `ModelState` while its `fit` runs (outside local mode), else None."""
    state = _strategy_of(model).model_states.get(model)
    if state is None or not state.fitting or in_local_mode():
        return None
    return state


def _check_outside_scope(model):
    # Compiled inside the scope but built outside it: the optimizer is the strategy's.
    in_scope = tf.distribute.has_strategy() and _asgd_strategy(tf.distribute.get_strategy())
    compiled_in_scope = _asgd_strategy(
        internals.optimizer_strategy(getattr(model, "optimizer", None))
    )
    if (in_scope or compiled_in_scope) and not _ours(model):
        raise ValueError(
            f"Model {model.name!r} was created outside "
            "`AsyncParameterServerStrategy.scope()`, so its variables are not "
            "on the parameter servers. Create and compile the model inside "
            "`with strategy.scope():`."
        )


_said_on_the_chief = weakref.WeakSet()  # plain models named in the log, per process


def _say_trains_on_the_chief(model):
    """Logs once per model that a model built and compiled outside the strategy's scope
    trains on the chief alone, where this process is connected to a cluster (a forgotten
    `with strategy.scope():` would otherwise pass unseen)."""
    if internals.server_def() is None or model in _said_on_the_chief:
        return
    _said_on_the_chief.add(model)
    log.warning(
        "tf_asgd: model %r was built and compiled outside "
        "`AsyncParameterServerStrategy.scope()`: it trains as plain Keras, on the chief "
        "alone. Build and compile it inside `with strategy.scope():` to train on the "
        "workers.",
        model.name,
    )


def _check_tables_connected(model):
    """Refuses a model whose layers hold a lookup table made before the strategy connected
    (a `TextVectorization` or `StringLookup` adapted at the top of the script): its
    resource stays on the old `/job:localhost` device, which no task knows, and every
    window would fail with "unknown device"."""
    for layer in internals.all_layers(model):
        for value in vars(layer).values():
            if not (hasattr(value, "resource_handle") and hasattr(value, "lookup")):
                continue
            device = value.resource_handle.device
            if device.startswith("/job:localhost"):  # ours is connected: no task has it
                raise ValueError(
                    f"Layer {layer.name!r} of model {model.name!r} holds a lookup table "
                    f"({type(value).__name__}) made before the strategy connected to the "
                    f"cluster: it lives on {device}, which no cluster task can run. Create "
                    "(and adapt) the layer after creating the strategy, for example under "
                    "`with strategy.scope():`."
                )


def _made_before_connecting(variable):
    """Where `variable` lives if it was made before the strategy connected (on the old
    `/job:localhost` device, which no task knows), else None."""
    device = getattr(getattr(variable, "value", variable), "device", "") or ""
    return device if device.startswith("/job:localhost") else None


def _check_metrics_connected(model):
    """Refuses a model compiled with a metric object made before the strategy connected
    (`keras.metrics.AUC()` at the top of the script): reading its variables failed with
    "Client for target /job:localhost ... not found"."""
    for v in internals.metric_objects_variables(model):
        if device := _made_before_connecting(v):
            raise ValueError(
                f"Model {model.name!r} was compiled with a metric whose variable "
                f"{getattr(v, 'path', v.name)!r} was made before the strategy connected to "
                f"the cluster: it lives on {device}, which no cluster task can run. Create "
                "the metric objects after creating the strategy (for example under `with "
                "strategy.scope():`), or name them (`metrics=['auc']`)."
            )


def _check_optimizer_connected(model):
    """Refuses a model compiled with an optimizer made before the strategy connected
    (`optimizer = keras.optimizers.Adam()` at the top of the script): no window could read
    its step counter and rate. One made after the strategy, even outside its scope, is
    honoured (`_symbolic_build`)."""
    optimizer = getattr(model, "optimizer", None)
    for inner in internals.wrapped_optimizers(optimizer) if optimizer is not None else ():
        for v in (internals.iteration_variable(inner), internals.learning_rate_variable(inner)):
            if device := _made_before_connecting(v):
                raise ValueError(
                    f"Model {model.name!r} was compiled with an optimizer "
                    f"({type(inner).__name__}) made before the strategy connected to the "
                    f"cluster: its variable {getattr(v, 'path', v.name)!r} lives on {device}, "
                    "which no cluster task can run. Create the optimizer after creating the "
                    "strategy (for example under `with strategy.scope():`), or name it "
                    "(`optimizer='adam'`)."
                )


def _wrap(name, ours_impl, entry_point=False):
    """Routes `TensorFlowTrainer.<name>` to `ours_impl` for our models. An entry point
    (fit, evaluate, predict) first checks that the model's strategy is still connected."""
    original = getattr(internals.TensorFlowTrainer, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if _ours(self):
            if entry_point:
                _strategy_of(self).check_connected()
                _check_tables_connected(self)
                if name != "predict":
                    _check_metrics_connected(self)
                if name == "fit":
                    _check_optimizer_connected(self)
                args, kwargs = _datasets_on_chief(original, self, args, kwargs)
            return ours_impl(original, self, *args, **kwargs)
        if name == "fit":
            _check_outside_scope(self)
            _say_trains_on_the_chief(self)
        if entry_point and internals.server_def() is not None:
            # A plain model (a loaded one) meets a dataset built before connecting too.
            args, kwargs = _datasets_on_chief(original, self, args, kwargs)
        return original(self, *args, **kwargs)

    wrapper._asgd_original = original
    setattr(internals.TensorFlowTrainer, name, wrapper)


def _datasets_on_chief(original, model, args, kwargs):
    """`(args, kwargs)` of `fit`, `evaluate` or `predict` with each `tf.data.Dataset`
    given as `x` or `validation_data` as the chief can iterate it
    (`input_sharding.on_chief`: one built before the strategy connected is rebuilt)."""
    try:
        bound = inspect.signature(original).bind(model, *args, **kwargs)
    except TypeError:
        return args, kwargs  # Keras says what is wrong
    for name in ("x", "validation_data"):
        value = bound.arguments.get(name)
        if isinstance(value, tf.data.Dataset):
            bound.arguments[name] = input_sharding.on_chief(value)
    return bound.args[1:], bound.kwargs


def _fit(original, model, *args, **kwargs):
    strategy = _strategy_of(model)
    state = strategy.model_states.get(model)
    if state is not None and state.fitting:
        raise RuntimeError("fit is already running on this model.")
    if not model.compiled:
        raise ValueError("You must call `compile()` before using the model.")
    _refuse_compile_options(model, strategy)
    model.train_function = None
    kwargs = _steps_and_repeated_data(original, model, args, kwargs)
    # Before Keras starts the epoch (and the workers' iterators): nothing scheduled.
    optimizer_options.check_window_steps(
        model.optimizer, strategy.n_sync, kwargs["steps_per_epoch"]
    )
    if model.steps_per_execution != strategy.n_sync:
        _say_batch_callbacks_run_per_window(kwargs["callbacks"], strategy.n_sync)
    feed = python_inputs.feed_of(kwargs["x"])
    if feed is not None:  # Python-side data: the chief reads it and sends the batches
        feed.steps_per_epoch = kwargs["steps_per_epoch"]
        python_inputs.start_fit(model, feed)
        log.info("tf_asgd: training data: read on the chief, each batch sent to one worker.")
    else:  # before anything is scheduled: a FILE policy it cannot honour raises here
        plan = strategy.training_data.shard_plan(kwargs["x"], strategy.num_workers)
        log.info("tf_asgd: training data: %s.", plan.describe())
    state = strategy.model_states.get_or_create(model)
    state.start_fit(kwargs["steps_per_epoch"], kwargs["epochs"] - kwargs["initial_epoch"])
    strategy.ps_recovery.start_fit()
    # One Keras "execution" is one window of n_sync steps, for this fit only.
    users_steps_per_execution = model.steps_per_execution
    model.steps_per_execution = strategy.n_sync
    failed = True
    try:
        result = original(model, **kwargs)
        failed = False
        return result
    except KeyboardInterrupt:
        failed = _INTERRUPTED
        raise
    except errors.WorkerStalledError:
        failed = _STALLED
        raise
    except tf.errors.OpError as e:
        _raise_if_ps_lost(e, strategy)
        raise
    finally:
        model.steps_per_execution = users_steps_per_execution
        state.end_fit()
        try:
            _join(strategy.coordinator, state.trainer, failed)
        finally:
            python_inputs.end_fit(model, state.trainer)
        if not failed and state.trainer is not None:  # for a PS lost before the next fit
            constraints.apply(state.trainer)  # every window finished
            strategy.ps_recovery.end_fit(state.trainer)


def _raise_if_ps_lost(error, strategy):
    """Raises `ClusterTaskLostError` from `error` where it is a PS's loss (`fit`, `evaluate`)."""
    lost = lost_tasks.ps_lost_error(error, strategy.cluster_spec)
    if lost is not None:
        raise lost from error


def _refuse_compile_options(model, strategy):
    """Raises `ValueError`, before anything is scheduled, for compile options
    that a window cannot honour.

    - `run_eagerly=True` with Keras's own `train_step`: a window runs the steps
      as a `tf.function` on a worker, so none of them would run eagerly (a
      model's own `train_step` is refused by `steps.ModelStep`, as a
      `TrainStepError`).
    - `steps_per_execution` other than 1 (Keras's default) or `n_sync`: one
      Keras execution is one window of `n_sync` steps.
    """
    if model.run_eagerly and type(model).train_step is keras.Model.train_step:
        raise ValueError(
            f"fit under AsyncParameterServerStrategy cannot honour `run_eagerly=True` "
            f"(model {model.name!r}): each window runs the training steps as a tf.function "
            "on a worker, so none of them would run eagerly. Compile with "
            "`run_eagerly=False` (the default), or debug the step eagerly in plain Keras, "
            "outside `strategy.scope()`."
        )
    spe = model.steps_per_execution
    if spe not in (1, strategy.n_sync) or isinstance(spe, bool):
        raise ValueError(
            f"fit under AsyncParameterServerStrategy cannot honour `steps_per_execution="
            f"{spe!r}` (model {model.name!r}): one Keras execution is one window of the "
            f"strategy's n_sync={strategy.n_sync} steps (batch-level callbacks run once per "
            "window). Compile with the default `steps_per_execution=1` or with "
            f"`steps_per_execution={strategy.n_sync}`, or give the strategy "
            f"`n_sync={spe!r}` for windows of that many steps."
        )


_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")
_said_per_window = set()  # callback classes already named in the log, per process


def _say_batch_callbacks_run_per_window(callbacks, n_sync):
    """Logs once per callback class that its batch-level methods run once per
    window of `n_sync` steps (Keras's `steps_per_execution` is `n_sync` during
    `fit`), as in Keras with `compile(steps_per_execution=n_sync)`."""
    if n_sync == 1 or not callbacks:
        return
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    names = []
    for callback in callbacks:
        if (
            getattr(callback, "save_freq", None) == "epoch"
            or getattr(callback, "update_freq", None) == "epoch"
        ):
            continue  # ModelCheckpoint, BackupAndRestore, TensorBoard: once per epoch
        if getattr(callback, "_tf_asgd_runs_per_window", False):
            continue  # written for windows (the launcher's callbacks)
        cls = type(callback)
        if cls not in _said_per_window and any(
            hook in vars(callback)  # e.g. LambdaCallback's
            or getattr(cls, hook, None) is not getattr(keras.callbacks.Callback, hook)
            for hook in _BATCH_HOOKS
        ):
            _said_per_window.add(cls)
            names.append(cls.__name__)
    if names:
        log.warning(
            "tf_asgd: %s: batch-level callback methods run once per window of n_sync=%d "
            "steps as the chief schedules it, with `batch` the window's last step and the "
            "logs of the windows finished so far: the central weights then hold only the "
            "finished windows (`windows` in the logs), not those still in flight, so a "
            "checkpoint saved every N batches holds fewer than N steps (Keras's "
            "steps_per_execution is n_sync during fit).",
            ", ".join(names),
            n_sync,
        )


_JOIN_ATTEMPTS = 8
_INTERRUPTED = "interrupted"  # `_join`'s `failed` after a KeyboardInterrupt
_STALLED = "stalled"  # ... after `WorkerStalledError`: already waited `connect_timeout`
# After Ctrl-C or SIGTERM, the longest wait for the windows scheduled: under the launcher's
# 60 s bound on stopping, with time left for its checkpoint.
STOP_WAIT_S = 20.0


def _join(coordinator, trainer, failed):
    """Waits for everything `fit` scheduled (windows, and the workers' dataset
    iterators, made before the model's trainer exists): nothing is left running
    after `fit`, even on an error, and the strategy is ready for the next `fit`.
    (A worker still making an iterator while a new strategy connected to the
    same cluster crashed the process.)

    After an error (a worker's, a callback's, a refusal) the
    windows' own errors are not raised again: the user sees the first error,
    not a CancelledError of the windows it stopped; the closures that failed
    are dropped, so the next `fit` does not raise their errors either. After a
    KeyboardInterrupt (`failed` is `_INTERRUPTED`) the wait is bounded
    (`wait_after_interrupt`); after a frozen worker (`_STALLED`) there is none.
    """
    if not failed:
        coordinator.join()
        if trainer is not None:  # a late recovery's windows; those `epoch_barrier` left running
            trainer.finish_fit()
        return
    if failed == _INTERRUPTED:
        wait_after_interrupt(coordinator)
    elif failed == _STALLED:
        pass  # the frozen worker's closure may never end; its windows push at most once
    else:
        for _ in range(_JOIN_ATTEMPTS):  # `join` returns at the first error; the rest may run on
            try:
                coordinator.join()
                break
            except Exception:  # the error that matters is already on its way
                continue
    if trainer is not None:
        trainer.drop_failed()


def wait_after_interrupt(coordinator):
    """After a KeyboardInterrupt (Ctrl-C, the launcher's SIGTERM): waits at most
    `STOP_WAIT_S` for what `coordinator` has scheduled. Stopping stays bounded when no
    worker can finish it (every worker lost, and waited for up to `connect_timeout`);
    what is still queued then runs once a worker is back, or never."""
    if not internals.wait_for_closures(coordinator, STOP_WAIT_S):
        log.warning(
            "Stopping without waiting longer for the work scheduled on the workers: none "
            "of it finished within %g s of the interrupt.",
            STOP_WAIT_S,
        )


def _dataset_batches(dataset, steps_per_epoch):
    """The batches of one pass over `dataset` where `fit` needs them (no `steps_per_epoch`):
    its cardinality, or, where `tf.data` does not know it (files, `filter`,
    `from_generator`), a count of one pass on the chief, logged (Keras learns it from the
    first epoch instead). Infinite stays negative (`fit` then asks for
    `steps_per_epoch`)."""
    num_batches = int(dataset.cardinality())
    if steps_per_epoch is not None or num_batches != tf.data.UNKNOWN_CARDINALITY:
        return num_batches
    num_batches, seconds = input_sharding.count_batches(dataset)
    log.warning(
        "The training data's length is unknown to tf.data: reading it once on the chief "
        "found %d batches (%.1f s), so an epoch is %d steps. Pass `steps_per_epoch` (or "
        "`tf.data.experimental.assert_cardinality`) to skip the count.",
        num_batches,
        seconds,
        num_batches,
    )
    return num_batches


def _steps_and_repeated_data(original, model, args, kwargs):
    """`fit`'s arguments with the training data repeated forever and an
    explicit `steps_per_epoch`.

    Workers draw from the data repeated forever, so Keras must not stop at
    the data's own length; and the trainer needs an epoch's steps to make the
    epoch exactly that many (its last window may be shorter than `n_sync`).
    Without `steps_per_epoch` an epoch is one pass over the data, as in Keras.
    Python-side data is handed to Keras as the stand-in dataset of its
    `python_inputs.ChiefFeed` (infinite; the chief reads the data itself).
    """
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    kw = dict(bound.arguments)
    kw.pop("self")
    x, num_batches = kw["x"], None
    python_input = _python_input_kind(x, kw["y"], kw["sample_weight"])
    arrays = python_input is None and not isinstance(x, tf.data.Dataset)
    if python_input is not None:
        _refuse_python_input_on_workers(_strategy_of(model), python_input)
        feed, kw["x"] = python_inputs.chief_feed(
            x,
            kw["y"],
            kw["sample_weight"],
            kw["batch_size"],
            kw["shuffle"],
            kw["class_weight"],
            python_input,
        )
        num_batches = feed.num_batches
        kw.update(y=None, sample_weight=None, class_weight=None, batch_size=None, shuffle=False)
    elif not arrays:
        num_batches = _dataset_batches(x, kw["steps_per_epoch"])
        kw["shuffle"] = False  # Keras ignores it for a dataset, with a warning
    else:
        if kw["validation_split"] and kw["validation_data"] is None:
            (kw["x"], kw["y"], kw["sample_weight"]), kw["validation_data"] = (
                internals.train_validation_split(
                    (kw["x"], kw["y"], kw["sample_weight"]), kw["validation_split"]
                )
            )
            kw["validation_split"] = 0.0
        x, num_batches = internals.keras_tf_dataset(
            x=kw["x"],
            y=kw["y"],
            sample_weight=kw["sample_weight"],
            batch_size=kw["batch_size"],
            shuffle=kw["shuffle"],
            class_weight=kw["class_weight"],
        )
        # Keras validates with fit's batch size unless told otherwise; the
        # hook hands Keras a batched dataset (batch_size None) below.
        kw["validation_batch_size"] = kw["validation_batch_size"] or kw["batch_size"]
        # Shuffled by the adapter already: Keras must not warn about `shuffle`.
        kw.update(y=None, sample_weight=None, class_weight=None, batch_size=None, shuffle=False)
    if kw["steps_per_epoch"] is None:
        if num_batches is None or num_batches < 0:
            raise ValueError(
                "fit under AsyncParameterServerStrategy needs `steps_per_epoch` for "
                "training data whose length is infinite or unknown: pass "
                "`steps_per_epoch=...` to `fit`."
            )
        if num_batches == 0:
            raise ValueError("The training data is empty: no batch to train on.")
        kw["steps_per_epoch"] = num_batches
    if python_input is not None:
        return kw  # infinite already; the chief reads it (`python_inputs`)
    _say_data_repeats(num_batches, kw)
    # Arrays make a new dataset every fit; the same tf.data.Dataset given to
    # a later fit trains on the same repeated dataset, so the workers keep
    # their iterators (`model_state.TrainingData.iterator`).
    kw["x"] = x.repeat() if arrays else _strategy_of(model).training_data.repeated(x)
    if arrays:
        _strategy_of(model).training_data.shard_by_batch(kw["x"])
    return kw


def _say_data_repeats(num_batches, kw):
    """Logs where an epoch's steps run past one pass over finite data: the workers draw
    from it repeated, where plain Keras ends each epoch when the data runs out ("Your
    input ran out of data")."""
    if num_batches is not None and 0 < num_batches < kw["steps_per_epoch"]:
        log.warning(
            "The training data holds %d batches, fewer than steps_per_epoch=%d: the workers "
            "draw from it repeated and train every step, where plain Keras ends each epoch "
            "when the data runs out. `.repeat()` it to say so.",
            num_batches,
            kw["steps_per_epoch"],
        )


PYTHON_INPUT_FIX = (
    "Feed the workers tensors instead: NumPy arrays (`fit(x, y, batch_size=...)`), a "
    "tf.data pipeline of TF ops (`tf.data.Dataset.from_tensor_slices(...)`, `.map` "
    "with TF ops), or write the data to TFRecord files (`tf.io.TFRecordWriter`) and read "
    "them with `tf.data.TFRecordDataset`. (validation_data may be any input: Python-side "
    "validation data is evaluated on the chief.)"
)

# Ops that call back into the Python interpreter that created them.
_PYTHON_OPS = {
    "PyFunc": "tf.numpy_function",
    "PyFuncStateless": "tf.numpy_function",
    "EagerPyFunc": "tf.py_function",
}
_EXTERNAL_STATE_IGNORE = 1  # DatasetToGraphV2's ExternalStatePolicy.IGNORE


def _refuse_python_input_on_workers(strategy, what):
    """Raises `ValueError`, before anything is scheduled, for Python-side
    training data (`what`, in words) that the workers would have to read:
    with a `per_worker_dataset_fn`, which transforms the dataset on each worker.

    Python-side data (a generator, a PyDataset, `py_function` /
    `numpy_function` in a tf.data pipeline) is otherwise read by the chief,
    which sends each closure its batches (`python_inputs`): a worker reading
    it would call back into the chief's interpreter for every batch, which
    stalls or deadlocks the cluster (the chief's main thread can hold the
    GIL while it waits on the workers).
    """
    if strategy.per_worker_dataset_fn is not None:
        raise ValueError(
            f"fit under AsyncParameterServerStrategy cannot apply `per_worker_dataset_fn` "
            f"to {what}: it runs Python on the chief, so the chief reads it and sends the "
            "batches to the workers (a worker reading it would call back into the chief's "
            "Python for each batch, which stalls or hangs the cluster). Drop "
            "`per_worker_dataset_fn` to train on it as it is, or "
            + PYTHON_INPUT_FIX[0].lower()
            + PYTHON_INPUT_FIX[1:]
        )


def _python_input_kind(x, y, sample_weight):
    """What runs Python in training data `x`, in words, or None."""
    if isinstance(x, tf.data.Dataset):
        return python_ops_in(x)
    if internals.is_array_input(x, y, sample_weight):
        return None
    if isinstance(x, keras.utils.PyDataset):
        return f"a keras.utils.PyDataset ({type(x).__name__})"
    if isinstance(x, (types.GeneratorType, collections.abc.Iterator)):
        return f"a Python generator ({type(x).__name__})"
    return f"a {type(x).__module__}.{type(x).__name__} (Keras reads it with Python)"


def python_ops_in(dataset):
    """The Python-calling ops of a tf.data pipeline, in words, or None.

    Walks the dataset's graph (`tf.raw_ops.DatasetToGraphV2`, the form in
    which it is shipped to the workers) and every function in its library.
    Serializing costs about as much as shipping the dataset does (about 1.6 s
    for 150 MB of in-memory tensors).
    """
    try:
        graph = tf.raw_ops.DatasetToGraphV2(
            input_dataset=tf.data.experimental.to_variant(dataset),
            external_state_policy=_EXTERNAL_STATE_IGNORE,
            strip_device_assignment=True,
        )
    except tf.errors.OpError:
        return None  # not serializable: shipping it to the workers will say why
    graph_def = tf.compat.v1.GraphDef.FromString(graph.numpy())
    found = set()
    for name, nodes in [("", graph_def.node)] + [
        (f.signature.name, f.node_def) for f in graph_def.library.function
    ]:
        for node in nodes:
            if node.op in _PYTHON_OPS:
                found.add(
                    "tf.data.Dataset.from_generator"
                    if "from_generator" in name
                    else _PYTHON_OPS[node.op]
                )
    if not found:
        return None
    return "a tf.data.Dataset that calls " + " and ".join(sorted(found))


def _make_train_function(original, model, force=False):
    if model.train_function is not None and not force:
        return model.train_function
    trainer = _window_trainer(model)
    recovery = _strategy_of(model).ps_recovery
    model.train_function = ps_recovery.train_function(trainer, recovery)
    if _fitting_state(model) is not None:
        ps_recovery.snapshot_at_start(trainer, recovery)  # before on_train_begin
    return model.train_function


def _get_metrics_result_or_logs(original, model, logs):
    if _fitting_state(model) is not None:
        trainer = _window_trainer(model)
        logs = ps_recovery.finish(trainer, _strategy_of(model).ps_recovery)
        if trainer.scheduler.quiet_at_epoch_end():
            constraints.apply(trainer)
        python_inputs.end_epoch(model)  # a PyDataset's on_epoch_end, where Keras calls it
        return logs
    return original(model, logs)


def _reset_metrics(original, model):
    """Keras's reset, then the epoch's metrics from it; in `fit` (each epoch's start, where
    the reset writes and reads the metric variables) a lost PS is recovered and the reset
    done again."""
    try:
        _reset_epoch_metrics(original, model)
    except tf.errors.OpError as e:
        _recover_in_fit(model, e)
        _reset_epoch_metrics(original, model)


def _reset_epoch_metrics(original, model):
    original(model)
    state = _fitting_state(model)
    if state is not None and state.trainer is not None:
        state.trainer.reset_metrics()


def _evaluate(original, model, *args, **kwargs):
    """`evaluate` on the workers when the strategy says so and they can, else
    Keras's own on the chief. (`fit` calls it for validation, with
    `_use_cached_eval_dataset=True`: the workers read the validation data
    given to `fit`, not Keras's cached chief iterator.)"""
    evaluator = _strategy_of(model).model_states.ensure_evaluator(model)
    if evaluator is not None and model.compiled:
        bound = inspect.signature(original).bind(model, *args, **kwargs)
        bound.apply_defaults()
        kw = dict(bound.arguments)
        kw.pop("self")
        extra = dict(kw.pop("kwargs", {}))
        extra.pop("_use_cached_eval_dataset", None)
        if not extra:
            done, result = _evaluate_on_workers(evaluator, model, kw)
            if done:
                return result
    return _on_chief(original, model, *args, **kwargs)


def _evaluate_on_workers(evaluator, model, kw):
    """`evaluator.evaluate(**kw)`; during `fit` (its validation) a lost PS is recovered
    (`ps_recovery`) and the evaluation runs again, else it is named."""
    try:
        return evaluator.evaluate(**kw)
    except tf.errors.OpError as e:
        if _fitting_state(model) is None:
            _raise_if_ps_lost(e, _strategy_of(model))
            raise
        _recover_in_fit(model, e)
    return evaluator.evaluate(**kw)


def _recover_in_fit(model, error):
    """Recovers from `error` during `model`'s `fit` where it is a PS's loss (`ps_recovery`),
    else raises it."""
    state = _fitting_state(model)
    if state is None or state.trainer is None:
        raise error
    _strategy_of(model).ps_recovery.recover(error, state.trainer)


def _on_chief(original, model, *args, **kwargs):
    """Keras's own `predict` or `evaluate` on the chief, against the central
    variables. Without XLA: an XLA-compiled function cannot read variables of
    another task (the PS), so `jit_compile=True` (honoured in the windows)
    is off for the call; the results are the same to float rounding."""
    jit = model.jit_compile
    model.jit_compile = False
    try:
        with local_mode():
            return original(model, *args, **kwargs)
    finally:
        model.jit_compile = jit


def _symbolic_build(original, model, iterator=None, data_batch=None):
    if iterator is not None:
        _check_input_shapes(model, internals.epoch_iterator_element_spec(iterator))
    if getattr(model, "optimizer", None) is not None and not model.optimizer.built:
        # An optimizer made outside the scope, after the strategy (`opt = Adam()` then
        # `compile(opt)` in the scope), places its slots as one made in the scope does.
        internals.adopt_optimizer(model.optimizer, _strategy_of(model))
    with local_mode():
        try:
            return original(model, iterator=iterator, data_batch=data_batch)
        except StopIteration:
            # No batch to build from (empty evaluation data): nothing runs, and
            # Keras's evaluate returns `[]`, as plain Keras does.
            if iterator is None:
                raise
            return None
        except RuntimeError:
            # Under any strategy Keras builds the model by calling it, which a
            # model that only overrides `train_step` (a GAN without `call`)
            # cannot take; plain Keras (no strategy) defers to the first trace
            # of `train_step`, as the window does (`steps.ModelStep.prepare`).
            if type(model).train_step is keras.Model.train_step or not all(
                layer.built for layer in model.layers
            ):
                raise
    if getattr(model, "optimizer", None) is not None and not model.optimizer.built:
        with _strategy_of(model).scope():
            model.optimizer.build(model.trainable_variables)


def _check_input_shapes(model, element_spec):
    """A clear error, before anything runs on the cluster, for data whose
    shapes the model cannot take."""
    inputs = getattr(model, "inputs", None) if model.built else None
    if not inputs:
        return
    x_spec = element_spec[0] if isinstance(element_spec, tuple) else element_spec
    x_specs = tf.nest.flatten(x_spec)
    if len(x_specs) != len(inputs):
        raise ValueError(
            f"The training data has {len(x_specs)} input(s); model {model.name!r} "
            f"takes {len(inputs)}."
        )
    for spec, inp in zip(x_specs, inputs):
        if not tf.TensorShape(spec.shape).is_compatible_with(inp.shape):
            raise ValueError(
                f"The training data's input shape {tuple(spec.shape)} does not match "
                f"model {model.name!r}'s input shape {tuple(inp.shape)}."
            )


def _train_on_batch(original, model, *args, **kwargs):
    raise NotImplementedError(
        "train_on_batch is not supported under AsyncParameterServerStrategy: "
        "a window needs a dataset iterator on each worker. Use model.fit."
    )


def install():
    """Installs the hook once. Raises if the Keras version is not supported."""
    global _installed
    if _installed:
        return
    internals.check_keras_version()
    # Before the strategy connects: freed functions are then removed only
    # from the connection that has them (no error lines, see internals).
    internals.guard_function_removal()
    _wrap("fit", _fit, entry_point=True)
    _wrap("make_train_function", _make_train_function)
    _wrap("_get_metrics_result_or_logs", _get_metrics_result_or_logs)
    _wrap("reset_metrics", _reset_metrics)
    _wrap("evaluate", _evaluate, entry_point=True)
    _wrap("predict", _on_chief, entry_point=True)
    _wrap("_maybe_symbolic_build", _symbolic_build)
    _wrap("train_on_batch", _train_on_batch)
    _wrap_batch_ends()
    _recover_in_callbacks()
    _installed = True


def _wrap_batch_ends():
    """Wraps `keras.callbacks.CallbackList.on_train_batch_end` (public): during
    a `fit` of one of our models, `batch` is the last step asked for
    (`WindowTrainer.last_step`), not Keras's index, which runs on to the next
    multiple of `n_sync` past an epoch whose last window is shorter (a progress
    bar at 50/45). Other callback lists are called unchanged."""
    original = keras.callbacks.CallbackList.on_train_batch_end

    @functools.wraps(original)
    def on_train_batch_end(self, batch, logs=None):
        model = getattr(self, "model", None)
        ours = isinstance(model, keras.Model) and _ours(model)
        state = _fitting_state(model) if ours else None
        if state is not None and state.trainer is not None:
            batch = min(batch, state.trainer.last_step())
            if internals.train_batch_ends_inline(self):
                return _call_each(self, model, "on_train_batch_end", batch, logs)
        return original(self, batch, logs)

    on_train_batch_end._asgd_original = original
    keras.callbacks.CallbackList.on_train_batch_end = on_train_batch_end


def _recover_in_callbacks():
    """Wraps `keras.callbacks.CallbackList.on_epoch_begin` and `on_epoch_end` (public):
    during a `fit` of one of our models each callback is called in turn, and one whose
    own reads of the central variables meet a lost PS (TensorBoard reading the learning
    rate, a checkpoint's save, a learning-rate schedule's assign) is called again once
    the PS is recovered (`ps_recovery`). Other callback lists are called unchanged."""
    for name in ("on_epoch_begin", "on_epoch_end"):
        original = getattr(keras.callbacks.CallbackList, name)
        setattr(keras.callbacks.CallbackList, name, _each_recovering(name, original))


def _each_recovering(name, original):
    @functools.wraps(original)
    def method(self, epoch, logs=None):
        model = getattr(self, "model", None)
        if not (isinstance(model, keras.Model) and _ours(model) and _fitting_state(model)):
            return original(self, epoch, logs)
        if name == "on_epoch_end":
            internals.flush_callbacks(self)
        return _call_each(self, model, name, epoch, logs)

    method._asgd_original = original
    return method


def _call_each(callback_list, model, name, index, logs):
    """Calls `name(index, logs)` of each callback of `callback_list`, as Keras does; one
    that raises a PS's loss is called again after the recovery (else it raises)."""
    logs = internals.pythonify_logs(logs)
    for callback in callback_list.callbacks:
        hook = getattr(callback, name)
        try:
            hook(index, logs)
        except tf.errors.OpError as e:
            _recover_in_fit(model, e)
            hook(index, logs)
