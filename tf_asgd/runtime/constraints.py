"""Keras weight constraints (`kernel_constraint=...`) on the central variables.

Each worker's optimizer applies a variable's `constraint` after each local step, as Keras
does. The PS then adds the workers' pushes, and a sum of constrained updates can leave the
constraint (a `NonNeg` kernel slightly below 0). So the chief applies every constraint to
the central variables where no push is in flight: at each epoch's end that waits for its
windows, and at the end of `fit`. Callbacks, validation, `evaluate` and a saved model then
see weights that meet it; in between, the central variables may leave it by what the
averaging adds. A sharded variable is constrained shard by shard.
"""

import weakref

import tensorflow as tf

from tf_asgd.runtime.push import raw, shard_variables

_by_trainer = weakref.WeakKeyDictionary()


class CentralConstraints:
    """The constraints of `variables` (Keras variables on the PS), applied on the PS.

    Args:
        variables: the model's central variables, e.g. `WindowTrainer.variables`.
    """

    def __init__(self, variables):
        self._pairs = [
            (v.constraint, shard)
            for v in variables
            if getattr(v, "constraint", None) is not None
            for shard in shard_variables(raw(v))
        ]
        self._run = tf.function(self._ops, autograph=False) if self._pairs else None

    def _ops(self):
        for constraint, shard in self._pairs:
            with tf.device(shard.device):
                value = tf.cast(constraint(shard.read_value()), shard.dtype)
                shard.assign(value, read_value=False)

    def __call__(self):
        if self._run is not None:
            self._run()


def apply(trainer):
    """Applies the constraints of `trainer`'s model to its central variables (call where
    no push is in flight)."""
    if trainer not in _by_trainer:
        _by_trainer[trainer] = CentralConstraints(trainer.variables)
    _by_trainer[trainer]()
