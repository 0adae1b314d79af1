"""Every private TensorFlow and Keras API that tf_asgd uses, in one place.

Keras 3 (3.13 to 3.15) has no parameter-server path and TF exposes no public way to poll
a `RemoteValue` or to apply a TF optimizer statelessly, so tf_asgd needs a
few internals. They are all here, each with a line saying why no public API
serves, so that a new TF or Keras release is checked against this one module
(and `keras_hook.py`, which patches the Keras trainer through it).

The version check runs first, before any private import: on an unsupported
Keras or TensorFlow, `import tf_asgd` fails with a `RuntimeError` naming the
versions it supports, not with an `ImportError` from deep inside Keras.
"""

import contextlib
import inspect
import os
import queue
import threading
import time
import types
import weakref

import keras
import tensorflow as tf

# The minor versions tools/dev/compat.py installed and tested (docs/compat.md).
# Every private API below is the same in all of them.
SUPPORTED_KERAS = ("3.13", "3.14", "3.15")
SUPPORTED_TF = ("2.19", "2.20", "2.21")


def _minor(version):
    """`"3.15.1"` -> `"3.15"`."""
    return ".".join(version.split(".")[:2])


def check_keras_version():
    """Raises `RuntimeError` unless the installed Keras and TensorFlow are of
    `SUPPORTED_KERAS` and `SUPPORTED_TF`: the hook patches Keras's trainer
    and uses TF internals, so other versions are refused, not guessed at."""
    found = [
        (name, version)
        for name, version, supported in (
            ("Keras", keras.__version__, SUPPORTED_KERAS),
            ("TensorFlow", tf.__version__, SUPPORTED_TF),
        )
        if _minor(version) not in supported
    ]
    if found:
        keras_pin = f"keras>={SUPPORTED_KERAS[0]},<{_next_minor(SUPPORTED_KERAS[-1])}"
        tf_pin = f"tensorflow>={SUPPORTED_TF[0]},<{_next_minor(SUPPORTED_TF[-1])}"
        raise RuntimeError(
            f"tf_asgd supports Keras {SUPPORTED_KERAS[0]} to {SUPPORTED_KERAS[-1]} and "
            f"TensorFlow {SUPPORTED_TF[0]} to {SUPPORTED_TF[-1]}; found "
            + " and ".join(f"{name} {version}" for name, version in found)
            + f'. Install supported versions: pip install "{keras_pin}" "{tf_pin}".'
        )


def _next_minor(minor):
    """`"3.15"` -> `"3.16"`."""
    major, m = minor.split(".")
    return f"{major}.{int(m) + 1}"


check_keras_version()

# Keras's TF trainer: the class whose fit/make_train_function keras_hook wraps
# (Keras 3 has no public extension point for a parameter-server fit).
# Keras's TF optimizer refuses `stateless_apply` under tf.distribute; the
# backend-neutral BaseOptimizer implementation is what a window needs.
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer  # noqa: F401 (re-exported)
from keras.src.optimizers.base_optimizer import BaseOptimizer

# Keras's own data adapters and validation split: `fit(steps_per_epoch=...)`
# on arrays must give the same batches Keras would, repeated (no public API).
from keras.src.trainers import data_adapters
from keras.src.trainers.data_adapters import array_slicing

# Whether a RemoteValue is ready without blocking: TF has no public poll and
# no wait-for-any over several RemoteValues.
from tensorflow.python.distribute.coordinator import remote_value

# A variable split by a `variable_partitioner`; public only as
# `tf.__internal__.distribute.ShardedVariable`.
from tensorflow.python.distribute.sharded_variable import ShardedVariable

# ---- Keras model and trainer -------------------------------------------------


def model_strategy(model):
    """The strategy `model` was created under, or None.

    Keras keeps it in `_distribute_strategy`; the public `distribute_strategy`
    falls back to the current strategy, which would make a model built
    outside the scope look like one built inside it.
    """
    return getattr(model, "_distribute_strategy", None)


def optimizer_strategy(optimizer):
    """The strategy `optimizer` was created under (Keras's TF optimizers keep it), or None."""
    return getattr(optimizer, "_distribution_strategy", None)  # (private: Keras's)


def adopt_optimizer(optimizer, strategy):
    """Makes `strategy` the one an unbuilt Keras TF `optimizer` made outside it places its
    slot variables with (Keras keeps the strategy current at the optimizer's creation)."""
    for inner in wrapped_optimizers(optimizer):
        if isinstance(inner, TFOptimizer) and not inner.built:
            inner._distribution_strategy = strategy  # (private: Keras's)


def loss_tracker(model):
    """The model's loss `Mean` metric (Keras exposes it only as `_loss_tracker`)."""
    return model._loss_tracker


def epoch_iterator_element_spec(iterator):
    """The element spec of a Keras `TFEpochIterator`'s dataset (no public accessor)."""
    return iterator._get_iterator().element_spec


def train_validation_split(arrays, validation_split):
    """Keras's own split for `fit(validation_split=...)`, as `(train, validation)`."""
    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def keras_tf_dataset(x, y, sample_weight, batch_size, shuffle, class_weight):
    """The `tf.data.Dataset` Keras's data adapter would feed `fit` for these
    arguments, and its number of batches (None if unknown)."""
    adapter = keras_data_adapter(x, y, sample_weight, batch_size, shuffle, class_weight)
    return adapter.get_tf_dataset(), adapter.num_batches


# ---- Keras optimizers ----------------------------------------------------------

_BASE_METHODS = (
    "assign",
    "assign_add",
    "assign_sub",
    "_backend_update_step",
    "_apply_weight_decay",
)


def _var_key(self, variable):
    # Inside a StatelessScope `variable.value` is the mapped tensor; key on
    # the tf.Variable itself, as the optimizer did when it was built.
    if isinstance(variable, keras.Variable):
        variable = variable._value
    return TFOptimizer._var_key(self, variable)


def wrapped_optimizers(optimizer):
    """`optimizer`, then the optimizers it wraps (a `LossScaleOptimizer`'s
    `inner_optimizer`, recursively). Keras has no public accessor for the
    general case."""
    chain = [optimizer]
    while isinstance(getattr(chain[-1], "inner_optimizer", None), keras.optimizers.Optimizer):
        chain.append(chain[-1].inner_optimizer)
    return chain


def iteration_variable(optimizer):
    """The variable that counts an optimizer's applies (for a
    `LossScaleOptimizer`, its inner optimizer's, which Keras reports as its
    `iterations`). `optimizer.iterations` is a tensor, not this variable,
    under `gradient_accumulation_steps` (it is `_iterations // steps`)."""
    return wrapped_optimizers(optimizer)[-1]._iterations


def moving_averages(optimizer):
    """`(trainable variable, its EMA variable)` pairs of an optimizer built
    with `use_ema=True` (Keras keeps them as `_trainable_variables` and
    `_model_variables_moving_average`; no public accessor); [] without EMA."""
    if not optimizer.use_ema or not optimizer.built:
        return []
    return [
        (v, a)
        for v, a in zip(optimizer._trainable_variables, optimizer._model_variables_moving_average)
        if a is not None
    ]


def accumulators(optimizer):
    """The gradient accumulators of an optimizer built with
    `gradient_accumulation_steps` (Keras's `_accumulated_gradients`), else []."""
    if not optimizer.gradient_accumulation_steps or not optimizer.built:
        return []
    return [a for a in optimizer._accumulated_gradients if a is not None]


def _stateless_apply_gradients(self, grads, trainable_variables):
    """`BaseOptimizer._backend_apply_gradients` inside a window (a
    `keras.StatelessScope` records every assign). The same steps, but
    gradient accumulation's `ops.cond` over assigns (an assign in a TF
    branch records a tensor that neither the other branch nor the scope
    may use) becomes a selection of values, as Keras's JAX optimizer does it
    (keras/src/backend/jax/optimizer.py), and the EMA is left to the PS,
    which updates it from the central variables at each push
    (`optimizer_options.CentralAverages`)."""
    steps = self.gradient_accumulation_steps
    if not steps:
        grads = self._clip_gradients(grads)
        self._apply_weight_decay(trainable_variables)
        self._backend_update_step(grads, trainable_variables, self.learning_rate)
        return
    is_update_step = tf.equal((self._iterations + 1) % steps, 0)
    acc = [self._accumulated_gradients[self._get_variable_index(v)] for v in trainable_variables]
    summed = [tf.convert_to_tensor(g) + a.value for g, a in zip(grads, acc)]
    before = [v.value for v in trainable_variables], [v.value for v in self.variables]
    grads = self._clip_gradients([s / steps for s in summed])
    self._apply_weight_decay(trainable_variables)
    self._backend_update_step(grads, trainable_variables, self.learning_rate)
    after = [v.value for v in trainable_variables], [v.value for v in self.variables]
    new_vars, new_opt = tf.cond(is_update_step, lambda: after, lambda: before)
    for v, value in zip(list(trainable_variables) + self.variables, new_vars + new_opt):
        v.assign(value)
    new_acc = tf.cond(is_update_step, lambda: [tf.zeros_like(s) for s in summed], lambda: summed)
    for a, value in zip(acc, new_acc):
        a.assign(value)


def _apply_statelessly(self, grads, trainable_variables=None):
    """`apply` of an optimizer with its own `stateless_apply` (a
    `LossScaleOptimizer`, whose `apply` on TF needs a `tf.distribute`
    replica context), inside a `keras.StatelessScope`: its `stateless_apply`
    on the scope's current values, the results assigned in the scope."""
    if trainable_variables is not None and [id(v) for v in trainable_variables] != [
        id(v) for v in self._trainable_variables
    ]:
        raise ValueError(
            f"{type(self).__name__}.apply inside a window takes gradients for the variables "
            "it was built with, in that order."
        )
    targets, state = list(self._trainable_variables), self.variables
    new_targets, new_state = type(self).stateless_apply(
        self, [v.value for v in state], list(grads), [v.value for v in targets]
    )
    for v, value in zip(targets + state, list(new_targets) + list(new_state)):
        v.assign(value)


def stateless_apply(optimizer, optimizer_values, grads, trainable_values):
    """`optimizer.stateless_apply` for Keras's TF optimizers, inside a window.

    Keras's TF optimizer refuses `stateless_apply` because of `tf.distribute`;
    inside a window there is no distribution to honour, so the backend-neutral
    implementation is used, with the TF optimizer's methods swapped for the
    base ones while it runs. An optimizer with its own `stateless_apply` (a
    `LossScaleOptimizer`) runs that one, on wrapped optimizers swapped so.
    """
    with stateless_optimizers(wrapped_optimizers(optimizer)):
        return optimizer.stateless_apply(optimizer_values, grads, trainable_values)


@contextlib.contextmanager
def stateless_optimizers(optimizers):
    """While open, `apply` of each of `optimizers` (Keras TF optimizers) runs
    Keras's backend-neutral implementation, as `stateless_apply` does: inside a
    `keras.StatelessScope` its assigns are recorded in the scope instead of
    being written to the (PS) variables through `tf.distribute`. With
    gradient accumulation or EMA, `_backend_apply_gradients` is
    `_stateless_apply_gradients`; an optimizer with its own `stateless_apply`
    (`LossScaleOptimizer`) applies through it (`_apply_statelessly`). An optimizer
    whose class overrides `_backend_update_step` (Nadam, to advance its
    `_u_product`) keeps its own, and its `super()` call reaches the
    backend-neutral one: TF's is swapped on `TFOptimizer` itself while open."""
    patched = []
    for optimizer in optimizers:
        names = [
            name
            for name in _BASE_METHODS
            if name != "_backend_update_step"
            or getattr(type(optimizer), name) is getattr(TFOptimizer, name)
        ]
        methods = {
            name: types.MethodType(getattr(BaseOptimizer, name), optimizer) for name in names
        }
        methods["_var_key"] = types.MethodType(_var_key, optimizer)
        own = type(optimizer).stateless_apply
        if own is TFOptimizer.stateless_apply:
            methods["stateless_apply"] = types.MethodType(BaseOptimizer.stateless_apply, optimizer)
        elif own is not BaseOptimizer.stateless_apply:
            methods["apply"] = types.MethodType(_apply_statelessly, optimizer)
        if optimizer.gradient_accumulation_steps or optimizer.use_ema:
            methods["_backend_apply_gradients"] = types.MethodType(
                _stateless_apply_gradients, optimizer
            )
        optimizer.__dict__.update(methods)
        patched.append((optimizer, methods))
    tf_update_step = TFOptimizer._backend_update_step
    TFOptimizer._backend_update_step = BaseOptimizer._backend_update_step  # see above
    try:
        yield
    finally:
        TFOptimizer._backend_update_step = tf_update_step
        for optimizer, methods in patched:
            for name in methods:
                optimizer.__dict__.pop(name, None)


@contextlib.contextmanager
def forward_losses(model, losses):
    """While open, `model.losses` is `losses` (of `stateless_call(...,
    return_losses=True)`), as Keras's JAX trainer hands a stateless forward
    pass's `add_loss` terms to `compute_loss`: the private `_losses_override`."""
    model._losses_override.clear()
    model._losses_override = list(losses)
    try:
        yield
    finally:
        model._losses_override.clear()


def learning_rate_variable(optimizer):
    """The optimizer's learning-rate variable, or None when it follows a schedule.

    Keras exposes `learning_rate` as a value; the variable is `_learning_rate`.
    """
    lr = getattr(optimizer, "_learning_rate", None)
    return lr if isinstance(lr, keras.Variable) else None


def has_rate_schedule(optimizer):
    """Whether the optimizer's rate (of the innermost optimizer it wraps) is a
    `LearningRateSchedule`, which Keras calls with the private `_iterations`."""
    rate = getattr(wrapped_optimizers(optimizer)[-1], "_learning_rate", None)  # private
    return isinstance(rate, keras.optimizers.schedules.LearningRateSchedule)


class _ScaledRate(keras.optimizers.schedules.LearningRateSchedule):
    """An optimizer's own rate (a variable, a schedule or a callable) times
    `scale_at(step)`, both at `step + step_offset`; read by Keras as any schedule,
    with the optimizer's step counter."""

    def __init__(self, rate, scale_at, step_offset=None):
        self.rate, self.scale_at, self.step_offset = rate, scale_at, step_offset

    def __call__(self, step):
        if self.step_offset is not None:
            step = tf.cast(step, tf.int64) + tf.cast(self.step_offset, tf.int64)
        rate = self.rate
        if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
            rate = rate(step)
        elif callable(rate) and not isinstance(rate, keras.Variable):
            rate = rate()
        return tf.cast(rate, tf.float32) * tf.cast(self.scale_at(step), tf.float32)


@contextlib.contextmanager
def scaled_learning_rate(optimizer, scale_at, step_offset=None):
    """While open (while a window is traced), `optimizer`'s steps run at its own
    learning rate times `scale_at(step)`, both read at its step counter plus
    `step_offset` (a tensor; None: 0). Keras reads the rate through the private
    `_learning_rate` (of the innermost optimizer a `LossScaleOptimizer` wraps); the
    variable itself, and what the chief and callbacks see, stay the user's."""
    inner = wrapped_optimizers(optimizer)[-1]
    rate = inner._learning_rate  # private: Keras's rate, a variable or a schedule
    inner._learning_rate = _ScaledRate(rate, scale_at, step_offset)  # private: as above
    try:
        yield
    finally:
        inner._learning_rate = rate  # private: as above


# ---- A model's own train_step on loop tensors (window.py, steps.py) ------------
# Keras's TF variable: inside a StatelessScope its value is the mapped tensor,
# but `handle` (what `tf.GradientTape` watches and differentiates against)
# still asks that tensor for a resource handle, and a read of it notifies no
# tape. Keras runs no TF `train_step` statelessly, so it has no public way.
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.backend.tensorflow.core import Variable as _TFVariable
from tensorflow.python.eager import tape as _tape


def _mapped(variable):
    scope = get_stateless_scope()
    value = scope.get_current_value(variable) if scope is not None else None
    return value if value is not None and not hasattr(value, "handle") else None


@contextlib.contextmanager
def differentiable_stateless_variables():
    """While open, a Keras variable mapped to a tensor by the current
    `keras.StatelessScope` behaves, for `tf.GradientTape`, as a TF variable
    does: reading a trainable one makes every active tape watch the tensor
    (unless the tape was made with `watch_accessed_variables=False`), and its
    `handle` is that tensor, so `tape.gradient(loss, variables)` and
    `tape.watch(variable)` reach the values the computation used. Outside a
    scope, or for an unmapped variable, nothing changes. Trace-time only:
    the class's properties are swapped while open (on the tracing thread)."""
    base_value = _TFVariable.value  # Keras's property, inherited
    base_handle = _TFVariable.__dict__["handle"]

    def value(self):
        # Watched before it is read: under mixed precision the read is a
        # cast of the mapped tensor, which a tape records only if it watches
        # the tensor already.
        if self.trainable and _mapped(self) is not None:
            _tape.variable_accessed(self)
        return base_value.fget(self)

    def handle(self):
        mapped = _mapped(self)
        return mapped if mapped is not None else base_handle.fget(self)

    _TFVariable.value, _TFVariable.handle = property(value), property(handle)
    try:
        yield
    finally:
        del _TFVariable.value
        _TFVariable.handle = base_handle


# ---- TF distribute ------------------------------------------------------------


def allow_run_without_coordinator(strategy):
    """Lets a `ParameterServerStrategy` run functions on the chief (evaluate,
    predict against the central variables); TF has only this private switch."""
    strategy.extended._allow_run_without_coordinator = True


def per_worker_variable(initial_value, **kwargs):
    """A non-trainable variable with one copy on each worker.

    `per_worker_variable=True` is a `tf.Variable` argument (TF 2.19 to 2.21)
    with no public documentation; create under the strategy's scope.
    """
    return tf.Variable(initial_value, per_worker_variable=True, trainable=False, **kwargs)


def is_sharded(raw):
    """Whether a `tf.Variable` is split over several PS (a `ShardedVariable`)."""
    return isinstance(raw, ShardedVariable)


def remote_value_ready(rv):
    """Whether a `RemoteValue` has its result (or error), without blocking."""
    return rv._status is not remote_value.RemoteValueStatus.NOT_READY


def remote_value_failed(rv):
    """Whether a `RemoteValue` is ready with an error (its `fetch` raises it)."""
    return remote_value_ready(rv) and rv._error is not None


def wait_briefly(rv, timeout=0.001):
    """Waits until `rv` is ready or `timeout` seconds pass (polling for any of
    several: TF has no wait-for-any on `RemoteValue`s)."""
    event = getattr(rv, "_status_available_event", None)
    if event is not None:
        event.wait(timeout)
    else:
        time.sleep(timeout)


# ---- tf.data -------------------------------------------------------------------


def flat_tensor_specs(element_spec):
    """A dataset element's components as a dataset variant encodes them (a
    ragged or sparse component is one variant): the `output_types` and
    `output_shapes` of raw dataset ops. `tf.TypeSpec` has no public accessor."""
    return [t for spec in tf.nest.flatten(element_spec) for t in spec._flat_tensor_specs]


def dataset_device(dataset):
    """The device of a dataset's variant tensor, where an iterator of it is made
    (`Dataset._variant_tensor`: no public accessor)."""
    return dataset._variant_tensor.device  # (private: TF's)


def dataset_inputs(dataset):
    """The datasets `dataset` reads (`Dataset._inputs`: no public accessor)."""
    return list(dataset._inputs())  # (private: TF's)


def host_address_space():
    """This process's task as its devices are named now (`/job:localhost/replica:0/task:0`
    until it connects to a cluster, then e.g. `/job:chief/replica:0/task:0`): where
    `tf.py_function` and `tf.numpy_function` pin their ops. TF's
    `context.host_address_space` has no public form."""
    from tensorflow.python.eager import context

    return context.context().host_address_space()  # (private: TF's)


def auto_shard_dataset(dataset, num_workers, index, policy):
    """TF's auto-shard graph rewrite (`FILE`: a share of the files before the reader;
    `HINT`: at `tf.data.experimental.SHARD_HINT`), as `MultiWorkerMirroredStrategy`
    applies it: `tf.raw_ops.AutoShardDataset`, its policy given explicitly (a dataset
    rebuilt from a graph has default options)."""
    specs = flat_tensor_specs(dataset.element_spec)
    variant = tf.raw_ops.AutoShardDataset(
        input_dataset=tf.data.experimental.to_variant(dataset),
        num_workers=num_workers,
        index=index,
        auto_shard_policy=int(policy),
        num_replicas=0,
        output_types=[s.dtype for s in specs],
        output_shapes=[s.shape for s in specs],
    )
    return tf.data.experimental.from_variant(variant, dataset.element_spec)


# ---- Inputs, checkpoints and shutdown under a parameter-server cluster --------


def is_array_input(x, y=None, sample_weight=None):
    """Whether Keras feeds `fit(x, y, sample_weight)` through its array adapter
    (NumPy, tensors, pandas, ...): no Python runs per batch. Every other
    non-`tf.data` input (PyDataset, generators, torch and grain loaders) is
    read by Python on the chief. Keras has no public predicate for it."""
    return data_adapters.array_data_adapter.can_convert_arrays((x, y, sample_weight))


def keras_data_adapter(x, y, sample_weight, batch_size, shuffle, class_weight):
    """Keras's own data adapter for `fit`'s training arguments, for the chief to
    read Python-side data as Keras would (`python_inputs.ChiefFeed`): its
    `get_numpy_iterator()` is one pass (shuffled, class-weighted, through a
    `PyDataset`'s `workers` / `use_multiprocessing` enqueuer), `num_batches`
    a pass's length, `on_epoch_begin` / `on_epoch_end` what Keras calls around
    an epoch. Keras has no public API that hands out these pieces."""
    return data_adapters.get_data_adapter(
        x=x,
        y=y,
        sample_weight=sample_weight,
        batch_size=batch_size,
        shuffle=shuffle,
        class_weight=class_weight,
    )


def adapter_reads_once(adapter):
    """Whether a Keras data adapter wraps a Python generator, which gives one
    pass only (a second `get_numpy_iterator()` would replay its first batches,
    which Keras peeked at for the element spec). No public predicate."""
    return isinstance(adapter, data_adapters.GeneratorDataAdapter)


def adapter_is_tf_dataset(adapter):
    """Whether a Keras data adapter wraps a `tf.data.Dataset` (no public predicate)."""
    return isinstance(adapter, data_adapters.TFDatasetAdapter)


def stop_adapter_workers(adapter):
    """Stops a `PyDataset` adapter's enqueuer (its reading threads or
    processes) if it runs: what the adapter's `on_epoch_end` does, without
    calling the user's `on_epoch_end`. The enqueuer is the adapter's private
    `enqueuer`; Keras stops it only through `on_epoch_end` or its `__del__`."""
    enqueuer = getattr(adapter, "enqueuer", None)
    if enqueuer is not None:
        enqueuer.stop()


def trace_checkpoint_writes(checkpoint):
    """Makes the writes of `checkpoint` (a `tf.train.Checkpoint`, as
    `tf.train.CheckpointManager.save` calls them) run one traced function.

    Why: executing eagerly with tensors on several tasks (the PS and the
    chief), TF's `MultiDeviceSaver.save` defines and traces a new tf.function
    on every save (functional_saver.py: "this will cause a function re-trace
    on each save"): a `tf.function retracing` warning from the 5th checkpoint
    on, and, under a parameter-server cluster, a function registered on every
    task and removed again (synchronous RPCs, see
    `stop_removing_functions_remotely`) per checkpoint. Saving inside one
    `tf.function` builds the save ops once. The manager calls the private
    `Checkpoint._write` (there is no public hook), so that is what is
    replaced, on this object only. The object graph is fixed at the first
    write: create every variable (optimizer slots included) before it.
    Writes with options other than callbacks (async checkpoints, an I/O
    device) take TF's own path.
    """
    write = checkpoint._write

    @tf.function(autograph=False)
    def traced(file_prefix):
        return write(file_prefix)

    def traced_write(file_prefix, options=None):
        callbacks = list(getattr(options, "experimental_write_callbacks", None) or ())
        if options is not None and (
            options.experimental_enable_async_checkpoint or options.experimental_io_device
        ):
            return write(file_prefix, options=options)
        tf.io.gfile.makedirs(os.path.dirname(file_prefix) or ".")
        path = traced(tf.constant(file_prefix, tf.string)).numpy().decode()
        for callback in callbacks:  # the manager's bookkeeping, as TF runs it
            callback(*([path] if inspect.signature(callback).parameters else []))
        return path

    checkpoint._write = traced_write
    return checkpoint


# Why the functions below exist: a `ParameterServerStrategy` turns off
# streaming enqueue (`TF_ENABLE_EAGER_CLIENT_STREAMING_ENQUEUE=False` in
# parameter_server_strategy_v2.py), so freeing a tf.function on the chief
# (`AtomicFunction.__del__` -> `EagerContext::RemoveFunction`) sends one
# synchronous `RemoveFunction` RPC to every remote task in turn and waits for
# each, holding the GIL (`TFE_ContextRemoveFunction` does not release it).
# For a task that is gone each logs `E0000 ... context.cc:911 Failed to remove
# function remotely` and a multi-line gRPC error; for one that does not answer
# it blocks every thread of the process. The same error ("Tried to remove
# non-existent function") comes back from live tasks for a function that
# existed before the current connection (each strategy connects anew: a new
# eager context on the tasks, without the old functions). TF has no public
# switch: the global eager context's `remove_function` (what
# `AtomicFunction.__del__` calls) and `set_server_def` / `update_server_def`
# (how a strategy connects, `tensorflow.python.eager.remote`) are wrapped. A
# function whose removal is skipped is leaked (its definition stays in this
# process, and on tasks that still have it), which is cheap.

_gone_tasks = set()  # "host:port" of tasks stopped for good
_removal = {"off": False}  # True once the process is about to exit
_older = set()  # functions that existed before the current connection
_connecting = threading.RLock()  # held while the eager context (re)connects


def guard_function_removal():
    """Installs the wrappers (once; call before connecting, as the Keras hook
    does): a freed function is removed only while connected to the cluster
    it was registered on, and not while a task of it is marked gone
    (`mark_tasks_gone`)."""
    from tensorflow.python.eager import context as eager_context  # the global eager context

    context = eager_context.context()
    if getattr(context.remove_function, "_tf_asgd_guard", False):
        return
    remove = context.remove_function

    def connecting(connect):
        def wrapper(*args, **kwargs):
            # One at a time: TF's coordinator reconnecting after a worker's loss while
            # the chief reconnects after a PS's crashed the process (a segfault).
            with _connecting:
                _older.clear()
                _older.update(context.list_function_names())
                return connect(*args, **kwargs)

        return wrapper

    def remove_function(name):
        name = name.decode() if isinstance(name, bytes) else name
        if _removal["off"] or _connected_to_gone_task(context):
            return
        if context.get_server_def() is not None and name in _older:
            _older.discard(name)
            return  # registered before this connection: the tasks do not have it
        remove(name)

    remove_function._tf_asgd_guard = True
    context.set_server_def = connecting(context.set_server_def)
    context.update_server_def = connecting(context.update_server_def)
    context.remove_function = remove_function


def mark_tasks_gone(addresses, gone=True):
    """Marks the tasks at `addresses` ("host:port") as stopped (`gone=False`:
    started again): while this process's eager context is connected to a
    cluster with a task that is gone, a freed tf.function is not removed
    (neither from the tasks nor locally), so no RPC goes to a dead task."""
    if gone:
        _gone_tasks.update(addresses)
    else:
        _gone_tasks.difference_update(addresses)
    guard_function_removal()


def stop_removing_functions_remotely():
    """From now on, tf.functions freed in this process are not removed at all.
    For a process about to exit (nothing remote follows)."""
    _removal["off"] = True
    guard_function_removal()


def _connected_to_gone_task(context):
    server_def = context.get_server_def()
    if server_def is None or not _gone_tasks:
        return False
    return any(
        set(job.tasks.values()) & _gone_tasks
        for job in server_def.cluster.job
        if job.name != server_def.job_name
    )


# ---- scheduling: closures scheduled as concrete functions ----------------------


def concrete_function_for(function, args):
    """The concrete function `ClusterCoordinator.schedule(function, args=args)`
    traces (per-worker arguments as worker 0's type specs), so that the chief
    can schedule it directly and skip the per-call dispatch of a `tf.function`
    (about 3 ms of the chief's CPU per closure). TF has no public way to trace
    a function against per-worker values."""
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    spec_args = tf.nest.map_structure(
        cluster_coordinator._maybe_as_type_spec,
        cluster_coordinator._select_worker_slice(0, args),
    )
    return function.get_concrete_function(*spec_args)


def per_worker_element_spec(iterator):
    """The element spec of a per-worker dataset iterator (the type spec the
    coordinator traces with, as `concrete_function_for`)."""
    from tensorflow.python.distribute.coordinator import cluster_coordinator

    return cluster_coordinator._maybe_as_type_spec(
        cluster_coordinator._select_worker_slice(0, iterator)
    )._element_spec


def pythonify_logs(logs):
    """Keras's conversion of metric results to Python numbers, as `evaluate`
    returns them (no public API)."""
    from keras.src.utils.python_utils import pythonify_logs as keras_pythonify_logs

    return keras_pythonify_logs(logs)


def train_batch_ends_inline(callback_list):
    """Whether a Keras `CallbackList` calls its callbacks' `on_train_batch_end` in `fit`'s
    thread (else in a thread of its own, where no callback overrides it: Keras's private
    `_async_train`)."""
    return not getattr(callback_list, "_async_train", False)


def flush_callbacks(callback_list):
    """Waits for a `CallbackList`'s batch-end calls dispatched to its thread, as Keras's
    own `on_epoch_end` does first (private `_flush_futures`)."""
    if getattr(callback_list, "_async_train", False):
        callback_list._flush_futures()


def flatten_metrics_in_order(model, logs):
    """`evaluate`'s list (or single value) of metric results, in Keras's order
    (`Trainer._flatten_metrics_in_order`, no public API)."""
    return model._flatten_metrics_in_order(logs)


def stop_coordinator(coordinator):
    """Stops a `ClusterCoordinator`'s threads, as only its destructor does."""
    if coordinator is not None:
        coordinator._cluster.stop()


# ---- TF coordinator: reconnecting after a worker failure (lost_workers.py) ------
# TF's coordinator has no public hook, bound or error for a worker that does not
# come back. Its failure handler (`WorkerPreemptionHandler`, in its own thread)
# reconnects with `context.update_server_def`, whose first RPC to each task
# waits until the task answers, without a bound, while it holds the lock that
# the workers' threads (waiting for the reconnection) and `Cluster.stop` need;
# the closures of failed workers wait in the queue meanwhile, so `join` and
# their `RemoteValue`s wait too. So the reconnection is gated here, and closures
# that cannot run are failed here, through the coordinator's private state.

_reconnect_gates = weakref.WeakKeyDictionary()  # failure handler's thread -> gate()


def coordinator_cluster(coordinator):
    """The coordinator's `Cluster` (its workers, closure queue and failure
    handler): what the functions below take."""
    return coordinator._cluster


def gate_reconnection(coordinator, gate):
    """Makes the coordinator's failure handler call `gate()` before each
    reconnection to the cluster: True reconnects, False skips it (the
    coordinator stops; TF's threads then end as after a reconnection). The
    gate runs in the handler's thread, holding the handler's lock.

    Returns:
        False where the failure handler is of an unknown kind (no gate).
    """
    handler = coordinator_cluster(coordinator).failure_handler
    thread = getattr(handler, "_preemption_handler_thread", None)
    if thread is None or not hasattr(handler, "_should_preemption_thread_run"):
        return False
    from tensorflow.python.eager import context as eager_context  # the global eager context

    context = eager_context.context()
    if not getattr(context.update_server_def, "_tf_asgd_gated", False):
        update = context.update_server_def

        def update_server_def(*args, **kwargs):
            gate_of_thread = _reconnect_gates.get(threading.current_thread())
            if gate_of_thread is not None and not gate_of_thread():
                return None
            return update(*args, **kwargs)

        update_server_def._tf_asgd_gated = True
        context.update_server_def = update_server_def
    _reconnect_gates[thread] = gate
    return True


def keep_worker_threads(coordinator):
    """Keeps TF's worker threads alive where a worker's recovery fails on a lost PS. A
    worker thread whose closure failed as a worker failure puts the closure back in the
    queue and waits for the reconnection; where that fails on a PS, it marks the closure
    failed as well, and `ClosureQueue.mark_failed` (no closure left in flight) raises
    `AssertionError`, which ends the thread for good (TF 2.21 `Worker._process_closure`):
    that worker never runs a closure again. Here the error is recorded (the next
    `schedule` or `join` raises it, as for any failed closure) and the thread goes on."""
    closures = coordinator._cluster.closure_queue

    def mark_failed(error):
        with closures._queue_lock:
            if closures._error is None:
                closures._error = error
            if closures._inflight_closure_count > 0:
                closures.inflight_closure_count -= 1
                if closures._inflight_closure_count == 0:
                    closures._no_inflight_closure_condition.notify_all()
            closures._stop_waiting_condition.notify_all()

    closures.mark_failed = mark_failed


def worker_thread_stack(coordinator, index):
    """What TF's coordinator thread for worker `index` of `coordinator` is doing: its
    stack, formatted, after a line with the worker's state (`_is_dead_with_error`, the
    closures queued for its own resources); None where no such thread runs. For a log
    line where that worker did not run a closure in time. The thread is found by its
    target (`Worker._process_queue`), not its name: a process holds one such thread per
    worker of every coordinator it made."""
    import sys
    import traceback

    worker = coordinator._cluster.workers[index]  # (private: TF's)
    queued = coordinator._cluster.closure_queue._tagged_queue[index].qsize()  # (private)
    thread = _worker_thread(worker)
    frame = sys._current_frames().get(thread.ident) if thread else None  # (private: CPython's)
    if frame is None:
        return None
    state = f"dead with error: {worker._is_dead_with_error!r}; queued for it: {queued}\n"
    return state + "".join(traceback.format_stack(frame))


def coordinator_stopping(cluster):
    """Whether the coordinator of `cluster` (`coordinator_cluster`) stops."""
    return not cluster.failure_handler._should_preemption_thread_run


def stop_worker_threads(cluster):
    """Tells the coordinator's worker threads to end after their current
    closure (what `Cluster.stop` does next, after the failure handler)."""
    for worker in cluster.workers:
        worker.stop()


def workers_awaiting_reconnection(cluster):
    """Indices of the workers whose thread waits for the reconnection (its
    last closure failed as a worker failure): they run no closure until then."""
    return [w.worker_index for w in cluster.workers if w._is_dead_with_error]


def revive_orphaned_workers(coordinator):
    """Lets TF's coordinator run closures again on the workers it still marks failed
    though their thread no longer waits for a reconnection: a worker whose recovery
    failed on a lost PS (TF's reconnection raised the PS's error in its thread, which
    `keep_worker_threads` keeps alive). TF clears the mark (`_is_dead_with_error`) only
    in a recovery of its own, so every per-worker resource made on such a worker
    meanwhile is aborted at once ("The corresponding function is aborted"), and a PS
    recovery's probe of it fails until `connect_timeout`. Here each such worker is
    recovered as TF recovers one (`Worker._on_worker_recovery`: its resources made
    again, the mark cleared); call it once the chief has reconnected to every task.

    Returns:
        The indices of the workers revived.
    """
    import sys

    revived = []
    for worker in coordinator._cluster.workers:  # (private: TF's)
        if not worker._is_dead_with_error:  # (private: TF's)
            continue
        thread = _worker_thread(worker)
        frame = sys._current_frames().get(thread.ident) if thread else None  # (private)
        names = []
        while frame is not None:
            names.append(frame.f_code.co_name)
            frame = frame.f_back
        if "wait_on_failure" in names or "_process_queue" not in names:
            continue  # waits for TF's own reconnection, which recovers it
        worker._on_worker_recovery()  # (private: TF's)
        revived.append(worker.worker_index)
    return revived


def _worker_thread(worker):
    """The thread of TF's coordinator that runs `worker`'s closures (found by its
    target, `Worker._process_queue`); None where none runs."""
    return next(
        (
            t
            for t in threading.enumerate()
            if getattr(getattr(t, "_target", None), "__self__", None) is worker
        ),
        None,
    )  # (private: `Thread._target`, CPython's)


def fail_waiting_closures(cluster, error):
    """Takes every closure waiting in the coordinator's queue out of it and
    sets `error` on its `RemoteValue` (`fetch` raises it); the next `join`
    (or `schedule`) raises it too, once, as TF does with a closure's error.

    Returns:
        How many closures were failed.
    """
    closures = cluster.closure_queue
    failed = 0
    with closures._queue_lock:
        while True:
            try:
                closure = closures._queue.get(block=False)
            except queue.Empty:
                break
            closure.maybe_call_with_output_remote_value(lambda rv: rv._set_error(error))
            failed += 1
        if failed:
            closures._queue_free_slot_condition.notify_all()
            if closures._error is None:
                closures._error = error
            closures._stop_waiting_condition.notify_all()
    return failed


def order_coordinator_stop(coordinator, before):
    """Makes the coordinator's stop (`Cluster.stop`, also run by its
    destructor) call `before()` first, then TF's own stop. `before` lets
    worker threads that wait for a reconnection end cleanly: once the failure
    handler's own stop has run, a worker thread woken from that wait fails an
    assertion (`wait_on_failure` asserts that the handler still runs). Called
    from the failure handler's own thread (a garbage collection inside a
    gate), TF's stop would wait for the lock that thread holds: the handler
    is then only told to stop."""
    handler = coordinator_cluster(coordinator).failure_handler
    tf_stop = handler.stop

    def stop():
        if threading.current_thread() is getattr(handler, "_preemption_handler_thread", None):
            handler._should_preemption_thread_run = False
            handler._cluster_due_for_update_or_finish.set()
            return
        before()
        tf_stop()

    handler.stop = stop


# ---- Recovering a restarted PS inside fit (ps_recovery.py) ---------------------
# TF has no public way to move a live variable to a new resource: a PS that comes
# back has lost its resources, the chief's handles to them are refused after the
# reconnection, and every function that captured one must be traced again. The
# facts behind each step: docs/ps_recovery.md.


def on_variable_created(strategy, callback):
    """Calls `callback(variable)` for every variable `strategy`'s scope creates from now
    on: the scope's creator calls `extended._create_variable` (TF has no public hook)."""
    extended = strategy.extended
    create = extended._create_variable

    def _create_variable(next_creator, **kwargs):
        variable = create(next_creator, **kwargs)
        callback(variable)
        return variable

    extended._create_variable = _create_variable


def _inner(variable):
    """The variable a strategy's wrapper holds (`_v` of `AggregatingVariable` and
    `CachingVariable`), or None for a resource variable."""
    inner = getattr(variable, "_v", None)
    return inner if inner is not None and inner is not variable else None


def call_takes_training(model):
    """Whether `model.call` takes a `training` argument (Keras's trainers pass it only
    then; `Layer._call_has_training_arg`)."""
    return bool(model._call_has_training_arg)  # (private: Keras's)


def all_layers(model):
    """Every layer of `model`, nested ones and itself included (Keras's
    `Layer._flatten_layers`; its public `layers` lists the top level only)."""
    return list(model._flatten_layers(include_self=True, recursive=True))  # (private)


def variable_layers(variable):
    """`variable` and every object under it: the shards of a `ShardedVariable` and what
    each wrapper holds, down to the `ResourceVariable`s."""
    if is_sharded(variable):
        return [layer for shard in variable.variables for layer in variable_layers(shard)]
    inner = _inner(variable)
    return [variable] + (variable_layers(inner) if inner is not None else [])


def resource_variables(variable):
    """The `ResourceVariable`s that hold `variable` under the strategy's wrappers."""
    return [layer for layer in variable_layers(variable) if _inner(layer) is None]


def is_per_worker(variable):
    """Whether `variable` has one copy on each worker (`per_worker_variable`)."""
    from tensorflow.python.distribute import ps_values

    return isinstance(variable, ps_values.PerWorkerVariable)


def per_worker_initial_value(variable):
    """The value a per-worker variable starts from on each worker: its instance on the
    chief, which TF creates with it and never updates (private `_coordinator_instance`)."""
    return variable._coordinator_instance.read_value()


def on_every_worker(coordinator, function):
    """Schedules `function` (a `tf.function` of no arguments) once on every worker, each
    after everything already queued for that worker's own resources; returns the
    `RemoteValue` of each run. TF's coordinator has no public way to address a worker (it
    does this privately to create per-worker resources)."""
    return list(coordinator._create_per_worker_resources(function)._values)


def rebuild_per_worker_iterator(coordinator, iterator):
    """Makes each worker's instance of `iterator` (from `create_per_worker_dataset`) anew,
    as TF's coordinator does for a worker that came back: the closure that created it runs
    again on that worker, before anything else queued for it. A `tf.data` iterator whose
    read was cancelled keeps the cancellation (or ends) for good. TF does this privately
    (`Worker._on_worker_recovery`: `_values`, `_closure`, `_schedule_resource`)."""
    for worker, value in zip(coordinator._cluster.workers, iterator._values):
        worker._schedule_resource(value._closure)


def server_def():
    """The chief's cluster definition once connected: what reconnects it to a PS that
    came back (`context.update_server_def`; TF keeps it privately)."""
    from tensorflow.python.eager import context

    return context.get_server_def()


def reconnect(server_def):
    """Connects the chief (and, through it, every task) again with `server_def`: each
    task gets a new eager context, so a restarted PS answers ops again."""
    from tensorflow.python.eager import context

    context.context().update_server_def(server_def)


def new_resource(variable, value):
    """Gives `variable` (a `ResourceVariable`) a new resource on its device holding `value`:
    the old handle is refused once the PS that held it has restarted."""
    from tensorflow.python.ops import resource_variable_ops

    with tf.device(variable.device):
        handle = resource_variable_ops._variable_handle_from_shape_and_dtype(
            shape=variable.shape,
            dtype=variable.dtype,
            shared_name=None,
            name=variable._shared_name or "Variable",
            graph_mode=False,
        )
        resource_variable_ops.assign_variable_op(
            handle, tf.convert_to_tensor(value, variable.dtype)
        )
    variable._handle = handle
    variable._cached_value = None


def forget_cached_read(layer):
    """Drops a wrapper's cached read of its variable (`CachingVariable._cache`; other
    layers have none)."""
    if hasattr(layer, "_cache"):
        layer._cache = None


def retrace_every_function():
    """Clears the traces of every `tf.function` in this process, so each is traced again
    on its next call: a trace captured the handles of the variables (TF has no public
    `clear cache`; `Function._function_cache` holds the traces)."""
    import gc

    from tensorflow.python.eager.polymorphic_function import polymorphic_function

    for obj in gc.get_objects():
        if isinstance(obj, polymorphic_function.Function):
            obj._function_cache.clear()


def wait_for_closures(coordinator, timeout):
    """Waits up to `timeout` seconds until no closure of `coordinator` runs or waits,
    swallowing their errors (the queue raises each once). Returns whether it emptied.

    TF's `ClosureQueue.wait(timeout)` is not bounded once a closure has failed: it
    then cancels the rest and waits, with no timeout, for every closure in flight, and
    a worker's closure stays in flight until TF reconnects to that worker (seconds,
    or for good). Here that wait is bounded too."""
    return wait_for_queue(coordinator._cluster.closure_queue, timeout)  # (private: TF's)


def wait_for_queue(closures, timeout):
    """`wait_for_closures` on TF's closure queue itself (`ClusterCoordinator`'s
    `_CoordinatedClosureQueue`, through its private state)."""
    deadline = time.monotonic() + timeout
    with closures._queue_lock:
        cancelled = False
        while True:
            failed = closures._error is not None
            if failed and closures._inflight_closure_count == 0:
                try:  # TF's own cancel: nothing in flight, so it does not wait
                    closures._raise_if_error()
                except Exception:  # noqa: BLE001 - swallowed, as documented
                    pass
                continue
            if not failed and closures._queue.empty() and closures._inflight_closure_count == 0:
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if failed and not cancelled:  # as TF's cancel starts: the closures in flight end
                closures._cancellation_mgr.start_cancel()
                cancelled = True
            condition = (
                closures._no_inflight_closure_condition
                if failed
                else closures._stop_waiting_condition
            )
            condition.wait(min(remaining, 0.1))


def metric_objects_variables(model):
    """The variables of every metric object `model` holds, also those `compile` was given
    that Keras builds only at the first step (`CompileMetrics` keeps them unbuilt)."""
    metrics = list(model.metrics)
    compiled = getattr(model, "_compile_metrics", None)  # (private: the metrics as given)
    for name in ("_user_metrics", "_user_weighted_metrics"):
        given = getattr(compiled, name, None)  # (private: CompileMetrics' own)
        metrics += [m for m in tf.nest.flatten(given) if isinstance(m, keras.metrics.Metric)]
    seen, out = set(), []
    for metric in metrics:
        for v in metric.variables:
            if id(v) not in seen:
                seen.add(id(v))
                out.append(v)
    return out
