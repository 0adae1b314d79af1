"""Every private TensorFlow and Keras API that tf_asgd uses, in one place.

Keras 3.15 has no parameter-server path and TF exposes no public way to poll
a `RemoteValue` or to apply a TF optimizer statelessly, so tf_asgd needs a
few internals. They are all here, each with a line saying why no public API
serves, so that a new TF or Keras release is checked against this one module
(and `keras_hook.py`, which patches the Keras trainer through it).

The Keras version check runs first, before any private import: on an
unsupported Keras, `import tf_asgd` fails with a message naming the versions
it supports, not with an `ImportError` from deep inside Keras.
"""

import time
import types

import keras
import tensorflow as tf

SUPPORTED_KERAS = ("3.15",)


def check_keras_version():
    """Raises `RuntimeError` unless the installed Keras is one of `SUPPORTED_KERAS`."""
    if not keras.__version__.startswith(SUPPORTED_KERAS):
        raise RuntimeError(
            f"tf_asgd's Keras hook supports Keras {', '.join(SUPPORTED_KERAS)}.x; "
            f"found {keras.__version__}."
        )


check_keras_version()

# Keras's TF trainer: the class whose fit/make_train_function keras_hook wraps
# (Keras 3 has no public extension point for a parameter-server fit).
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer  # noqa: E402,F401
# Keras's TF optimizer refuses `stateless_apply` under tf.distribute; the
# backend-neutral BaseOptimizer implementation is what a window needs.
from keras.src.backend.tensorflow.optimizer import TFOptimizer  # noqa: E402
from keras.src.optimizers.base_optimizer import BaseOptimizer  # noqa: E402
# Keras's own data adapters and validation split: `fit(steps_per_epoch=...)`
# on arrays must give the same batches Keras would, repeated (no public API).
from keras.src.trainers import data_adapters  # noqa: E402
from keras.src.trainers.data_adapters import array_slicing  # noqa: E402
# Keras's CIFAR batch reader, with its restricted (numpy-only) unpickler.
from keras.src.datasets.cifar import load_batch as load_cifar_batch  # noqa: E402,F401
# Whether a RemoteValue is ready without blocking: TF has no public poll and
# no wait-for-any over several RemoteValues.
from tensorflow.python.distribute.coordinator import remote_value  # noqa: E402
# A variable split by a `variable_partitioner`; public only as
# `tf.__internal__.distribute.ShardedVariable`.
from tensorflow.python.distribute.sharded_variable import ShardedVariable  # noqa: E402


# ---- Keras model and trainer -------------------------------------------------


def model_strategy(model):
    """The strategy `model` was created under, or None.

    Keras keeps it in `_distribute_strategy`; the public `distribute_strategy`
    falls back to the current strategy, which would make a model built
    outside the scope look like one built inside it.
    """
    return getattr(model, "_distribute_strategy", None)


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
    adapter = data_adapters.get_data_adapter(
        x=x, y=y, sample_weight=sample_weight,
        batch_size=batch_size, shuffle=shuffle, class_weight=class_weight,
    )
    return adapter.get_tf_dataset(), adapter.num_batches


# ---- Keras optimizers ----------------------------------------------------------

_BASE_METHODS = ("assign", "assign_add", "assign_sub", "_backend_update_step", "_apply_weight_decay")


def _var_key(self, variable):
    # Inside a StatelessScope `variable.value` is the mapped tensor; key on
    # the tf.Variable itself, as the optimizer did when it was built.
    if isinstance(variable, keras.Variable):
        variable = variable._value
    return TFOptimizer._var_key(self, variable)


def stateless_apply(optimizer, optimizer_values, grads, trainable_values):
    """`optimizer.stateless_apply` for Keras's TF optimizers, inside a window.

    Keras's TF optimizer refuses `stateless_apply` because of `tf.distribute`;
    inside a window there is no distribution to honour, so the backend-neutral
    implementation is used, with the TF optimizer's methods swapped for the
    base ones while it runs.
    """
    patched = {name: types.MethodType(getattr(BaseOptimizer, name), optimizer) for name in _BASE_METHODS}
    patched["_var_key"] = types.MethodType(_var_key, optimizer)
    optimizer.__dict__.update(patched)
    try:
        return BaseOptimizer.stateless_apply(optimizer, optimizer_values, grads, trainable_values)
    finally:
        for name in patched:
            optimizer.__dict__.pop(name, None)


def learning_rate_variable(optimizer):
    """The optimizer's learning-rate variable, or None when it follows a schedule.

    Keras exposes `learning_rate` as a value; the variable is `_learning_rate`.
    """
    lr = getattr(optimizer, "_learning_rate", None)
    return lr if isinstance(lr, keras.Variable) else None


# ---- TF distribute ------------------------------------------------------------


def allow_run_without_coordinator(strategy):
    """Lets a `ParameterServerStrategy` run functions on the chief (evaluate,
    predict against the central variables); TF has only this private switch."""
    strategy.extended._allow_run_without_coordinator = True


def per_worker_variable(initial_value, **kwargs):
    """A non-trainable variable with one copy on each worker.

    `per_worker_variable=True` is a TF 2.21 `tf.Variable` argument with no
    public documentation; create under the strategy's scope.
    """
    return tf.Variable(initial_value, per_worker_variable=True, trainable=False, **kwargs)


def is_sharded(raw):
    """Whether a `tf.Variable` is split over several PS (a `ShardedVariable`)."""
    return isinstance(raw, ShardedVariable)


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


# ---- tf.data -------------------------------------------------------------------


def flat_tensor_specs(element_spec):
    """A dataset element's components as a dataset variant encodes them (a
    ragged or sparse component is one variant): the `output_types` and
    `output_shapes` of raw dataset ops. `tf.TypeSpec` has no public accessor."""
    return [t for spec in tf.nest.flatten(element_spec) for t in spec._flat_tensor_specs]
