"""The narrow hook into Keras 3's TensorFlow trainer.

Keras 3.15 has no parameter-server path: under TF's `ParameterServerStrategy`
its `fit` raises `ValueError: To use this dataset, you need to pass this
dataset to ClusterCoordinator.create_per_worker_dataset`. `install()` wraps a
few methods of `keras.src.backend.tensorflow.trainer.TensorFlowTrainer`; each
wrapper checks whether the model's strategy is an
`AsyncParameterServerStrategy` and otherwise calls the original unchanged.

For models of ours:
- `fit` checks the model, puts the strategy in training mode (datasets are
  then handed out as per-worker iterators) and drives windows;
- `make_train_function` returns a function that schedules one window closure
  (`scheduling.WindowTrainer`) per `n_sync` steps and returns at once;
- `_get_metrics_result_or_logs` (called by `fit` at each epoch's end) joins
  the windows and returns the epoch's metrics and push counters;
- `evaluate`, `predict` and `_maybe_symbolic_build` run on the chief against
  the central variables, with datasets handed out as local iterators;
- `train_on_batch` is refused (windows need an iterator per worker).

Pinned to the Keras versions in `SUPPORTED_KERAS`; `install()` refuses others
rather than patch code it has not been tested against.

The module also holds `stateless_apply`: Keras's TF optimizer refuses
`stateless_apply` because of `tf.distribute`; inside a window there is no
distribution to honour, so the backend-neutral implementation is used.
"""

import contextlib
import functools
import inspect
import threading
import time
import types

import keras
import tensorflow as tf
from keras.src.trainers import data_adapters
from keras.src.trainers.data_adapters import array_slicing
from keras.src.backend.tensorflow import trainer as tf_trainer
from keras.src.backend.tensorflow.optimizer import TFOptimizer
from keras.src.optimizers.base_optimizer import BaseOptimizer
from tensorflow.python.distribute.coordinator import remote_value

SUPPORTED_KERAS = ("3.15",)

_installed = False
_thread = threading.local()  # local-mode depth, per thread


def _ours(model):
    from tf_asgd.strategy import AsyncParameterServerStrategy

    return isinstance(getattr(model, "_distribute_strategy", None), AsyncParameterServerStrategy)


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


def remote_value_ready(rv):
    """Whether a `RemoteValue` has its result (or error), without blocking."""
    return rv._status is not remote_value.RemoteValueStatus.NOT_READY


def wait_briefly(rv, timeout=0.001):
    """Waits until `rv` is ready or `timeout` seconds pass (polling for any of
    several: TF has no wait-for-any on `RemoteValue`s)."""
    event = getattr(rv, "_status_available_event", None)
    if event is not None:
        event.wait(timeout)
    else:
        time.sleep(timeout)


_BASE_METHODS = ("assign", "assign_add", "assign_sub", "_backend_update_step", "_apply_weight_decay")


def _var_key(self, variable):
    # Inside a StatelessScope `variable.value` is the mapped tensor; key on
    # the tf.Variable itself, as the optimizer did when it was built.
    if isinstance(variable, keras.Variable):
        variable = variable._value
    return TFOptimizer._var_key(self, variable)


def stateless_apply(optimizer, optimizer_values, grads, trainable_values):
    """`optimizer.stateless_apply` for Keras's TF optimizers, inside a window."""
    patched = {name: types.MethodType(getattr(BaseOptimizer, name), optimizer) for name in _BASE_METHODS}
    patched["_var_key"] = types.MethodType(_var_key, optimizer)
    optimizer.__dict__.update(patched)
    try:
        return BaseOptimizer.stateless_apply(optimizer, optimizer_values, grads, trainable_values)
    finally:
        for name in patched:
            optimizer.__dict__.pop(name, None)


def _window_trainer(model):
    from tf_asgd.scheduling import WindowTrainer

    trainer = getattr(model, "_asgd_trainer", None)
    if trainer is None or trainer.model is not model or trainer.optimizer is not model.optimizer:
        trainer = WindowTrainer(model, model._distribute_strategy)
        model._asgd_trainer = trainer
    return trainer


def _check_outside_scope(model):
    from tf_asgd.strategy import AsyncParameterServerStrategy

    if tf.distribute.has_strategy() and isinstance(
        tf.distribute.get_strategy(), AsyncParameterServerStrategy
    ) and not _ours(model):
        raise ValueError(
            f"Model {model.name!r} was created outside "
            "`AsyncParameterServerStrategy.scope()`, so its variables are not "
            "on the parameter servers. Create and compile the model inside "
            "`with strategy.scope():`."
        )


def _wrap(name, ours_impl):
    original = getattr(tf_trainer.TensorFlowTrainer, name)

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if _ours(self):
            return ours_impl(original, self, *args, **kwargs)
        if name == "fit":
            _check_outside_scope(self)
        return original(self, *args, **kwargs)

    wrapper._asgd_original = original
    setattr(tf_trainer.TensorFlowTrainer, name, wrapper)


def _fit(original, model, *args, **kwargs):
    if getattr(model, "_asgd_fitting", False):
        raise RuntimeError("fit is already running on this model.")
    model._assert_compile_called("fit")
    strategy = model._distribute_strategy
    if model.steps_per_execution != strategy.n_sync:
        # One Keras "execution" is one window of n_sync steps.
        model.steps_per_execution = strategy.n_sync
    model.train_function = None
    kwargs = _repeat_when_steps_given(original, model, args, kwargs)
    model._asgd_fitting = True
    try:
        return original(model, **kwargs)
    finally:
        model._asgd_fitting = False
        trainer = getattr(model, "_asgd_trainer", None)
        if trainer is not None:
            trainer.coordinator.join()  # nothing left running after fit, even on error


def _repeat_when_steps_given(original, model, args, kwargs):
    """Workers draw from the training data repeated forever; with an explicit
    `steps_per_epoch` Keras must not stop at the data's own length."""
    bound = inspect.signature(original).bind(model, *args, **kwargs)
    bound.apply_defaults()
    kw = dict(bound.arguments)
    kw.pop("self")
    if kw["steps_per_epoch"] is None:
        return kw
    x = kw["x"]
    if isinstance(x, tf.data.Dataset):
        kw["x"] = x.repeat()
        return kw
    if kw["validation_split"] and kw["validation_data"] is None:
        (kw["x"], kw["y"], kw["sample_weight"]), kw["validation_data"] = (
            array_slicing.train_validation_split(
                (kw["x"], kw["y"], kw["sample_weight"]),
                validation_split=kw["validation_split"],
            )
        )
        kw["validation_split"] = 0.0
    adapter = data_adapters.get_data_adapter(
        x=kw["x"], y=kw["y"], sample_weight=kw["sample_weight"],
        batch_size=kw["batch_size"], shuffle=kw["shuffle"],
        class_weight=kw["class_weight"],
    )
    kw.update(x=adapter.get_tf_dataset().repeat(), y=None, sample_weight=None,
              class_weight=None, batch_size=None)
    return kw


def _make_train_function(original, model, force=False):
    if model.train_function is not None and not force:
        return model.train_function
    trainer = _window_trainer(model)
    model.train_function = trainer.train_function
    return model.train_function


def _get_metrics_result_or_logs(original, model, logs):
    if getattr(model, "_asgd_fitting", False) and not in_local_mode():
        return _window_trainer(model).finish()
    return original(model, logs)


def _reset_metrics(original, model):
    original(model)
    trainer = getattr(model, "_asgd_trainer", None)
    if trainer is not None and getattr(model, "_asgd_fitting", False) and not in_local_mode():
        trainer.reset_metrics()


def _on_chief(original, model, *args, **kwargs):
    with local_mode():
        return original(model, *args, **kwargs)


def _symbolic_build(original, model, iterator=None, data_batch=None):
    if iterator is not None:
        _check_input_shapes(model, iterator._get_iterator().element_spec)
    with local_mode():
        return original(model, iterator=iterator, data_batch=data_batch)


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
    if not keras.__version__.startswith(SUPPORTED_KERAS):
        raise RuntimeError(
            f"tf_asgd's Keras hook supports Keras {', '.join(SUPPORTED_KERAS)}.x; "
            f"found {keras.__version__}."
        )
    _wrap("fit", _fit)
    _wrap("make_train_function", _make_train_function)
    _wrap("_get_metrics_result_or_logs", _get_metrics_result_or_logs)
    _wrap("reset_metrics", _reset_metrics)
    _wrap("evaluate", _on_chief)
    _wrap("predict", _on_chief)
    _wrap("_maybe_symbolic_build", _symbolic_build)
    _wrap("train_on_batch", _train_on_batch)
    _installed = True
