"""GEM, Gradient Energy Matching (Hermans & Louppe 2018), as a Keras optimizer.

Each worker rescales its update element-wise so that the asynchronous system's kinetic
energy stays at or below that of a momentum-SGD proxy (learning rate `eta` and momentum
`mu` of the wrapped optimizer). Per push, with the worker's update `g = -eta * grad`:
`m <- mu * m + g`; `dc = central_now - central_at_previous_pull`;
`pi = clip((kappa * |m| - |dc|) / (|g| + eps), 0, pi_max)`; push `pi * g`
(`gem_rule.gem_step`). Windows of `n_sync` steps: docs/architecture.md.

Example:
    >>> import keras, tf_asgd
    >>> opt = tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.1, momentum=0.9), kappa=2.0)
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile(opt, "mse")
"""

import math

import keras
import numpy as np
import tensorflow as tf
import tensorflow.experimental.numpy as tnp
from keras import ops

from tf_asgd import internals
from tf_asgd.rules import gem_rule


@keras.saving.register_keras_serializable(package="tf_asgd")
class GEM(keras.optimizers.Optimizer):
    """Gradient Energy Matching around a momentum-SGD proxy.

    Args:
        optimizer: the proxy, a `keras.optimizers.SGD` with `momentum > 0`
            (its learning rate, schedules included, and momentum are used).
        kappa: amplification of the proxy's energy (the paper: 1, with 2 a
            good value); > 0.
        pi_max: upper clip of `pi` (the reference code: 5); > 0.
        epsilon: added to `|g|` in the denominator; >= 0.
        name: the optimizer's name.
        **kwargs: `keras.optimizers.Optimizer`'s options (`clipnorm`,
            `clipvalue`, ...); a `learning_rate` is ignored (the proxy's is used).
            Under `AsyncParameterServerStrategy`, `use_ema`,
            `gradient_accumulation_steps`, `loss_scale_factor` and
            `weight_decay` are refused (`UnsupportedFeatureError`).

    Raises:
        ValueError: `optimizer` is not a Keras optimizer, not
            `keras.optimizers.SGD` with `momentum > 0`, or has `nesterov=True`;
            `kappa` or `pi_max` not a finite number > 0, or `epsilon` not one >= 0.

    Example:

    ```python
    with strategy.scope():
        model = tf_asgd.models.digits_convnet()
        model.compile(
            tf_asgd.optimizers.GEM(keras.optimizers.SGD(0.05, momentum=0.9), kappa=2.0),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(x, y, epochs=3)  # the PS adds every push as is (`OuterSGD()`)
    names, pi = tf_asgd.optimizers.gem.pi_history(model)
    ```
    """

    def __init__(
        self,
        optimizer,
        kappa=1.0,
        pi_max=gem_rule.GEM_PI_MAX,
        epsilon=gem_rule.GEM_EPSILON,
        name="gem",
        **kwargs,
    ):
        if isinstance(optimizer, dict):
            optimizer = keras.optimizers.deserialize(optimizer)
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(f"GEM wraps a Keras optimizer, got {optimizer!r}.")
        momentum = getattr(optimizer, "momentum", None)
        if not isinstance(optimizer, keras.optimizers.SGD) or not momentum or momentum <= 0:
            raise ValueError(
                "GEM's proxy is momentum SGD: wrap keras.optimizers.SGD with "
                f"momentum > 0, got {type(optimizer).__name__} with momentum={momentum!r}."
            )
        if getattr(optimizer, "nesterov", False):
            raise ValueError("GEM's proxy is plain momentum SGD; nesterov=True is not supported.")
        _check_positive("kappa", kappa)
        _check_positive("pi_max", pi_max)
        _check_positive("epsilon", epsilon, allow_zero=True)
        kwargs.pop("learning_rate", None)
        lr = optimizer._learning_rate
        if not isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) and not callable(lr):
            lr = float(ops.convert_to_numpy(lr))
        super().__init__(learning_rate=lr, name=name, **kwargs)
        self.inner = optimizer
        self.momentum = float(momentum)
        self.kappa, self.pi_max, self.epsilon = float(kappa), float(pi_max), float(epsilon)
        self.asgd_push_rule = GEMPushRule(self)

    def build(self, variables):
        """Creates the proxy momentum and the previous variable value of each variable.

        Args:
            variables: the variables this optimizer updates.
        """
        if self.built:
            return
        super().build(variables)
        self.proxy_momentums = [
            self.add_variable_from_reference(v, name="proxy_momentum") for v in variables
        ]
        self.previous_central = [
            self.add_variable_from_reference(v, name="previous_central") for v in variables
        ]

    def update_step(self, gradient, variable, learning_rate):
        """GEM in one process: `variable += pi * g`, its own last move as `dc`.

        Args:
            gradient: the variable's gradient.
            variable: the variable to update.
            learning_rate: the proxy's learning rate at this step.
        """
        # One process: one worker pushing every step, so `dc` is the variable's
        # own last move.
        i = self._get_variable_index(variable)
        m, prev = self.proxy_momentums[i], self.previous_central[i]
        lr = ops.cast(learning_rate, variable.dtype)
        g = -lr * ops.cast(gradient, variable.dtype)
        dc = ops.where(self.iterations > 0, variable - prev, ops.zeros_like(variable))
        pushed, new_m, _ = gem_rule.gem_step(
            g, m, dc, self.momentum, self.kappa, self.pi_max, self.epsilon, xp=tnp
        )
        self.assign(prev, variable)
        self.assign(m, new_m)
        self.assign_add(variable, pushed)

    def get_config(self):
        """The optimizer's config: the proxy's (serialized), `kappa`, `pi_max`, `epsilon`.

        Returns:
            A dict that `GEM.from_config` rebuilds an optimizer with the same settings from.
        """
        config = super().get_config()
        config.pop("learning_rate", None)
        config.update(
            optimizer=keras.optimizers.serialize(self.inner),
            kappa=self.kappa,
            pi_max=self.pi_max,
            epsilon=self.epsilon,
        )
        return config


def _check_positive(name, value, allow_zero=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"GEM's {name} must be a finite number {bound}, got {value!r}.")


class GEMPushRule:
    """GEM's part of a window (see the module docstring): local plain SGD,
    then `pi * g` pushed. Used by `window.WindowFunction`."""

    def __init__(self, gem):
        self.gem = gem
        self._local = None

    def local_optimizer(self, trainable_variables):
        """Plain SGD at the proxy's learning rate, for the local steps, with
        GEM's own gradient clipping (as GEM's `apply` clips in one process;
        the proxy's other options are unused there too)."""
        if self._local is None:
            g_ = self.gem
            config = dict(
                g_.inner.get_config(),
                momentum=0.0,
                nesterov=False,
                name="gem_local_sgd",
                clipnorm=g_.clipnorm,
                clipvalue=g_.clipvalue,
                global_clipnorm=g_.global_clipnorm,
                weight_decay=None,
                use_ema=False,
                loss_scale_factor=None,
                gradient_accumulation_steps=None,
            )
            self._local = keras.optimizers.SGD.from_config(config)
            self._local.build(trainable_variables)
        return self._local

    def create_worker_state(self, trainable_variables):
        """Per-worker `m`, previous pull, and a first-window flag."""

        def per_worker(v, name):
            return internals.per_worker_variable(tf.zeros(v.shape, v.dtype), name=name)

        self.momentums = [per_worker(v, "gem_m") for v in trainable_variables]
        self.previous = [per_worker(v, "gem_prev") for v in trainable_variables]
        self.started = internals.per_worker_variable(False, name="gem_started")
        return self.momentums + self.previous + [self.started]

    def transform(self, updates, pulled):
        """Returns `(pushed, state_updates, pi_stats)` for the trainable updates.

        `pi_stats` is a `[n_variables, 3]` tensor: mean of `pi`, fraction
        clipped at 0, fraction clipped at `pi_max`.
        """
        g_ = self.gem
        started = self.started.read_value()
        pushed, state, stats = [], [], []
        for g, c, m_var, p_var in zip(updates, pulled, self.momentums, self.previous):
            prev = p_var.read_value()
            dc = tf.where(started, c - prev, tf.zeros_like(c))
            out, new_m, pi = gem_rule.gem_step(
                g, m_var.read_value(), dc, g_.momentum, g_.kappa, g_.pi_max, g_.epsilon, xp=tnp
            )
            pushed.append(out)
            state += [(m_var, new_m), (p_var, c)]
            stats.append(
                tf.stack(
                    [
                        tf.reduce_mean(pi),
                        tf.reduce_mean(tf.cast(pi <= 0.0, pi.dtype)),
                        tf.reduce_mean(tf.cast(pi >= g_.pi_max, pi.dtype)),
                    ]
                )
            )
        state.append((self.started, tf.constant(True)))
        return pushed, state, tf.stack(stats)


def pi_history(model):
    """GEM's `pi` per pushed window and trainable tensor, over the model's training so far.

    Args:
        model: a Keras model compiled with `GEM` and trained with `fit` under
            an `AsyncParameterServerStrategy`.

    Returns:
        `(names, stats)`: the trainable variables' paths and a NumPy array
        `[windows, n_variables, 3]` of pi's mean, fraction clipped at 0 and
        fraction clipped at `pi_max`, one row per pushed window, in the order
        the windows finished.

    Raises:
        ValueError: `model` has not been trained with GEM under an
            `AsyncParameterServerStrategy`.

    Example:

    ```python
    names, stats = tf_asgd.optimizers.gem.pi_history(model)
    print(dict(zip(names, stats[-10:, :, 0].mean(axis=0))))  # mean pi, last 10 windows
    ```
    """
    # The strategy keeps the model's trainer in its `model_states`; it is
    # recognised by its marker, as the Keras hook does (no import of the
    # strategy module).
    strategy = internals.model_strategy(model)
    state = (
        strategy.model_states.get(model)
        if getattr(strategy, "_is_tf_asgd_strategy", False)
        else None
    )
    trainer = None if state is None else state.trainer
    if trainer is None or trainer.push_rule is None:
        raise ValueError(
            f"Model {model.name!r} has not been trained with GEM under an "
            "AsyncParameterServerStrategy."
        )
    names = [v.path for v in model.trainable_variables]
    rows = [r.pi for r in trainer.window_log if r.pushed]
    return names, np.stack(rows) if rows else np.zeros([0, len(names), 3])


class PiMonitor(keras.callbacks.Callback):
    """Writes GEM's `pi` per tensor to TensorBoard at each epoch's end.

    Scalars `gem_pi/<variable path>/{mean,zero,max}`, averaged over the
    epoch's windows, as in the paper's figures of `pi` per tensor over time.
    An epoch without pushed windows writes nothing.

    Args:
        log_dir: the TensorBoard log directory the summary file is written to.

    Example:

    ```python
    model.fit(x, y, epochs=5, callbacks=[tf_asgd.optimizers.gem.PiMonitor("logs/pi")])
    ```
    """

    def __init__(self, log_dir):
        super().__init__()
        self.log_dir = log_dir
        self._writer = None
        self._seen = 0

    def on_epoch_end(self, epoch, logs=None):
        """Writes the epoch's mean `pi` statistics per tensor, at step `epoch`.

        Args:
            epoch: the epoch's index (the summaries' step).
            logs: Keras's logs (unused).

        Raises:
            ValueError: the model is not trained with GEM under an
                `AsyncParameterServerStrategy` (`pi_history`).
        """
        names, stats = pi_history(self.model)
        epoch_stats, self._seen = stats[self._seen :], len(stats)
        if not len(epoch_stats):
            return
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)
        with self._writer.as_default(step=epoch):
            for name, (mean, zero, top) in zip(names, epoch_stats.mean(axis=0)):
                tf.summary.scalar(f"gem_pi/{name}/mean", mean)
                tf.summary.scalar(f"gem_pi/{name}/zero", zero)
                tf.summary.scalar(f"gem_pi/{name}/max", top)
        self._writer.flush()

    def on_train_end(self, logs=None):
        """Closes the summary writer (a later `fit` opens a new one).

        Args:
            logs: Keras's logs (unused).
        """
        if self._writer is not None:
            self._writer.close()
            self._writer = None
