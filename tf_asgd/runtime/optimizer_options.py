"""Keras optimizer options under windows: each honoured exactly, or refused.

Every option of Keras 3's `BaseOptimizer`, and mixed precision, either means under
`AsyncParameterServerStrategy` what it means in plain Keras, or is refused with an
`UnsupportedFeatureError` before any window is scheduled. Clipping, weight decay and loss
scaling run per local step by Keras's own code; gradient accumulation keeps whole cycles
per window (`check_window_steps`); the EMA follows the central variables on the PS
(`CentralAverages`). Each option, and what is refused: docs/architecture.md.
"""

import keras
import tensorflow as tf

from tf_asgd import internals
from tf_asgd.errors import UnsupportedFeatureError
from tf_asgd.rules import worker_rate
from tf_asgd.runtime.push import device_of, raw, read, shards


def _refuse(feature, why, instead):
    return UnsupportedFeatureError(
        f"{feature} is not supported under tf_asgd.AsyncParameterServerStrategy: {why} "
        f"Instead: {instead}"
    )


def _is_gem(optimizer):
    return getattr(optimizer, "asgd_push_rule", None) is not None


# Keras's optimizers whose step is normalised per coordinate (or a sign): Adam's kin.
_ADAPTIVE = (
    "Adam", "AdamW", "Adamax", "Nadam", "Lamb", "Lion",
    "RMSprop", "Adagrad", "Adadelta", "Adafactor",
)  # fmt: skip


def is_adaptive(optimizer):
    """Whether `optimizer` (a loss-scaling wrapper unwrapped) is, or subclasses, one of
    Keras's adaptive optimizers (Adam, AdamW, Adamax, Nadam, Lamb, Lion, RMSprop,
    Adagrad, Adadelta, Adafactor): under `lr_scaling="auto"` their workers' rate anneals
    from N (`worker_rate.auto_worker_rate`). Any other optimizer is not.

    Example:
        >>> is_adaptive(keras.optimizers.Adam()), is_adaptive(keras.optimizers.SGD())
        (True, False)
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return any(isinstance(inner, getattr(keras.optimizers, name)) for name in _ADAPTIVE)


def auto_worker_rate(optimizer, synchronous=False, outer_given=False):
    """The rule `lr_scaling="auto"` resolves to for `optimizer`: its kind (`is_adaptive`)
    and whether its rate is a schedule decide it (`worker_rate.auto_worker_rate`).

    Example:
        >>> auto_worker_rate(keras.optimizers.Adam()), auto_worker_rate(keras.optimizers.SGD())
        ('anneal', 'sqrt')
    """
    return worker_rate.auto_worker_rate(
        synchronous,
        outer_given=outer_given,
        adaptive=is_adaptive(optimizer),
        scheduled=internals.has_rate_schedule(optimizer),
    )


# Adam's kin that keep a second-moment estimate with a `beta_2`.
_SECOND_MOMENT = ("Adam", "Adamax", "Nadam", "Lamb")  # AdamW subclasses Adam


def second_moment_beta(optimizer):
    """`beta_2` of `optimizer` (a loss-scaling wrapper unwrapped) where it is Adam or one
    of its kin with a second-moment estimate (AdamW, Adamax, Nadam, Lamb), else None: the
    workers' warm-up is capped at `worker_rate.untuned_warmup_steps` of it.

    Example:
        >>> second_moment_beta(keras.optimizers.Adam()), second_moment_beta(keras.optimizers.Lion())
        (0.999, None)
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if not any(isinstance(inner, getattr(keras.optimizers, n)) for n in _SECOND_MOMENT):
        return None
    return float(inner.beta_2)


def check_compiled(optimizer):
    """Refuses what the compiled optimizer (run by Keras's step in a window)
    cannot honour. Raises `UnsupportedFeatureError`."""
    chain = internals.wrapped_optimizers(optimizer)
    gem = next((o for o in chain if _is_gem(o)), None)
    if gem is not None:
        if gem is not optimizer:
            raise _refuse(
                "`mixed_float16` (a `LossScaleOptimizer`) with GEM",
                "GEM's push rule runs its own local SGD and loss scaling would wrap "
                "GEM's update, not that SGD.",
                "train GEM under the float32 policy.",
            )
        for option in (
            "use_ema",
            "gradient_accumulation_steps",
            "loss_scale_factor",
            "weight_decay",
        ):
            if getattr(gem, option, None):
                raise _refuse(
                    f"`{option}` on GEM (`{gem.name}`)",
                    "a window pushes GEM's rescaled update of plain local SGD steps, "
                    "which do not carry this option.",
                    f"compile GEM without `{option}`, or a plain Keras optimizer with it.",
                )
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and any(
        o.gradient_accumulation_steps for o in chain
    ):
        raise _refuse(
            "`gradient_accumulation_steps` with a `LossScaleOptimizer` (`mixed_float16`)",
            "a step skipped for non-finite gradients does not advance the step count, "
            "so one worker's accumulation cycle would drift from the shared step count.",
            "use `gradient_accumulation_steps` under the float32 or mixed_bfloat16 policy, "
            "or a larger batch.",
        )


def check_own_train_step(model, optimizers):
    """Refuses the options that a model's own `train_step` (`steps.ModelStep`)
    cannot have honoured for `optimizers`. Raises `UnsupportedFeatureError`."""
    for optimizer in optimizers:
        for option, why in (
            (
                "gradient_accumulation_steps",
                "how many times `train_step` applies an optimizer per step is not known "
                "before it runs, so windows cannot be cut into whole accumulation cycles.",
            ),
            ("use_ema", "the PS keeps the average for the compiled optimizer's Keras step only."),
        ):
            if getattr(optimizer, option, None):
                raise _refuse(
                    f"`{option}` on optimizer `{optimizer.name}` of {type(model).__name__}, "
                    "which overrides `train_step`,",
                    why,
                    f"compile without `{option}` (accumulate or average in `train_step` "
                    "itself, with variables the model holds), or train with Keras's own "
                    "`train_step`.",
                )


def accumulation_steps(optimizer):
    """The compiled chain's `gradient_accumulation_steps` (1 without)."""
    return max(
        [o.gradient_accumulation_steps or 1 for o in internals.wrapped_optimizers(optimizer)]
    )


def check_window_steps(optimizer, n_sync, steps_per_epoch):
    """Refuses windows that are not whole gradient-accumulation cycles: every
    window (`n_sync` steps, and an epoch's last, `steps_per_epoch % n_sync`)
    must be a multiple of the accumulation steps. Call before scheduling an
    epoch. Raises `UnsupportedFeatureError`."""
    cycle = accumulation_steps(optimizer)
    if cycle == 1:
        return
    if n_sync % cycle or (steps_per_epoch and steps_per_epoch % cycle):
        raise _refuse(
            f"`gradient_accumulation_steps={cycle}` with n_sync={n_sync} and "
            f"steps_per_epoch={steps_per_epoch}",
            "every window must hold whole accumulation cycles, or one worker's partial "
            "cycle would be averaged with gradients of a later pull.",
            f"make `n_sync` and the epoch's steps multiples of {cycle} (pass "
            "`steps_per_epoch`, or choose the batch size).",
        )


class CentralAverages:
    """Keras's EMA (`use_ema`) of one optimizer, of the central variables,
    kept on the PS and updated at each push (see the module docstring).

    Create under the strategy's scope.

    Args:
        optimizer: the optimizer with `use_ema=True` (built).
        counter: the variable on the PS that a push advances by this
            optimizer's steps (its `_iterations`, or the compiled optimizer's
            that stands for it).
        index: where this optimizer's advance is in the push's advances.
        central: the central variables; the optimizer must average only these.
        strategy: the strategy (its counters' PS holds the overwrite count).
    """

    def __init__(self, optimizer, counter, index, central, strategy):
        self.pairs = internals.moving_averages(optimizer)
        ids = {id(v) for v in central}
        stray = [v.path for v, _ in self.pairs if id(v) not in ids]
        if stray:
            raise _refuse(
                f"`use_ema` on optimizer `{optimizer.name}`",
                f"it averages variables that are not the model's ({', '.join(stray[:3])}).",
                "build the optimizer on the model's trainable variables.",
            )
        self.momentum = float(optimizer.ema_momentum)
        self.cycle = optimizer.gradient_accumulation_steps or 1
        self.frequency = optimizer.ema_overwrite_frequency
        self.counter, self.index = counter, index
        self.overwrites = None
        if self.frequency:
            with strategy.scope(), strategy.extended.colocate_vars_with(strategy.counters.version):
                # Overwrites made so far; from the step count now, so that a
                # restored step count does not trigger one at once.
                start = self._reached(tf.constant(int(raw(counter).numpy()), tf.int64))
                self.overwrites = tf.Variable(start, trainable=False, name="ema_overwrites")

    def _reached(self, steps):
        """How many times Keras would have overwritten the variables after
        `steps` optimizer applies (`(iterations + 1) % frequency == 0` at a
        step, `iterations` counting accumulation cycles)."""
        cycles = tf.where(steps > 0, (steps - 1) // self.cycle + 1, tf.zeros_like(steps))
        return cycles // self.frequency

    def update(self, advance, ticket, after):
        """The PS's EMA update for one push; call inside a window closure.

        Args:
            advance: int64 scalar on the counters' PS: this optimizer's
                applies in the push (0 when nothing was pushed: nothing changes).
            ticket: int64 scalar there, the push's version ticket.
            after: a tensor that exists once every write of the push is done
                (the central variables and step counter then read hold it).

        Returns:
            The write ops.
        """
        counter = raw(self.counter)
        with tf.device(device_of(counter)), tf.control_dependencies([after]):
            steps = tf.cast(read(counter), tf.int64)
            before = steps - advance
            first = tf.logical_or(tf.equal(ticket, 0), tf.equal(before // self.cycle, 0))
            momentum = tf.where(
                first,
                tf.zeros([], tf.float64),
                tf.pow(tf.constant(self.momentum, tf.float64), tf.cast(advance, tf.float64)),
            )
            pushed = advance > 0
            ops, overwrite = [], None
            if self.overwrites is not None:
                done, reached = self.overwrites.read_value(), self._reached(steps)
                overwrite = tf.logical_and(pushed, reached > done)
                ops.append(
                    self.overwrites.assign(tf.where(overwrite, reached, done), read_value=False)
                )
        for var, average in self.pairs:
            rv, ra = raw(var), raw(average)
            with tf.device(device_of(ra)), tf.control_dependencies([after]):
                value, old = read(rv), read(ra)
                m = tf.cast(momentum, old.dtype)
                new = m * old + (1 - m) * value  # Keras's order of operations
            ops += _write_if(pushed, shards(ra, new))
            if overwrite is not None:
                ops += _write_if(overwrite, shards(rv, new))
        return ops


def _write_if(condition, pieces):
    """Assigns each `(PS variable, value)` where it lives, if `condition`."""
    ops = []
    for variable, value in pieces:

        def write(variable=variable, value=value):
            with tf.control_dependencies([variable.assign(value, read_value=False)]):
                return tf.constant(True)

        with tf.device(variable.device):
            ops.append(tf.cond(condition, write, lambda: tf.constant(False)))
    return ops
