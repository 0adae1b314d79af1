"""The accuracy studies' setups, typed: a user's recipe (data, model, optimizer, batch) with
plain Keras's steps and the emulated device time of one batch; and what builds them.

Example:
>>> from benchmarks import setups
>>> setups.SETUPS["mnist1d64k_adam"].batch
32
"""

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Setup:
    """One recipe, named in `SETUPS`."""

    data: str  # a data set of `load_data`
    model: str  # a `tf_asgd.models` builder
    optimizer: str  # an optimizer of `make_optimizer`
    batch: int
    steps: int = 0  # plain Keras's steps, which set the target (0: the suite's own)
    device_ms: float = 0.0  # the emulated device time of one batch
    epochs: int = 0  # the epochs of a `fit` where a suite runs epochs, not steps


# One a line: Setup(data, model, optimizer, batch, steps, device_ms).
SETUPS = {
    "mnist1d_adam": Setup("mnist1d", "mnist1d_cnn", "adam_1e-2", 100, 3000, 50.0),
    "mnist1d_sgd": Setup("mnist1d", "mnist1d_cnn", "sgd_0.05_m0.9", 100, 3000, 50.0),
    "mnist1d16k_adam": Setup("mnist1d16k", "mnist1d_cnn", "adam_1e-2", 100, 3000, 50.0),
    # Large enough that batches of N x 32 keep paying (nothing memorised); Adam's rate is
    # the best final of a grid at batch 32 (docs/defaults.md).
    "mnist1d64k_adam": Setup("mnist1d64k", "mnist1d_cnn", "adam_4e-3", 32, 8000, 20.0),
    # Another model family (attention, LayerNorm) at Keras's default Adam rate.
    "mnist1d_transformer_adam": Setup(
        "mnist1d", "mnist1d_transformer", "adam_1e-3", 32, 1500, 20.0
    ),
    "digits_sgd": Setup("digits", "digits_convnet", "sgd_0.05_m0.9", 32, 900, 50.0),
    "digits_adam": Setup("digits", "digits_convnet", "adam_1e-3", 32, 900, 50.0),
    "resnet_sgd": Setup("digits32", "resnet_bn", "sgd_resnet", 32, 450, 400.0),
    # Adam's kin other than Adam, at Keras's default rates (Lion's: 3x below AdamW's,
    # as its paper advises): the rules' checks beyond the recipes they were chosen on.
    "digits_adamw": Setup("digits", "digits_convnet", "adamw_1e-3", 32, 900, 50.0),
    "digits_rmsprop": Setup("digits", "digits_convnet", "rmsprop_1e-3", 32, 900, 50.0),
    "digits_lion": Setup("digits", "digits_convnet", "lion_3e-4", 32, 900, 50.0),
    "digits_nadam": Setup("digits", "digits_convnet", "nadam_1e-3", 32, 900, 50.0),
    # Rates well above Keras's default, where N times them may pass the edge.
    "digits_adam_hot": Setup("digits", "digits_convnet", "adam_1e-2", 32, 900, 50.0),
    "mnist1d_transformer_adam_hot": Setup(
        "mnist1d", "mnist1d_transformer", "adam_3e-3", 32, 1500, 20.0
    ),
    # A decoder with causal attention on a synthetic language task, under a Transformer's
    # usual recipe: AdamW, a linear warm-up over 10% of the fit, then cosine decay.
    "lookup_decoder_adamw": Setup(
        "lookup64", "causal_decoder", "adamw_cosine_1e-3", 32, 2000, 20.0
    ),
}


# The fault suite's recipes: `fit` runs `epochs`, not steps.
FAULT_SETUPS = {
    "digits_convnet": Setup("digits", "digits_convnet", "sgd_0.05_m0.9", batch=32, epochs=16),
    "mnist1d_cnn": Setup("mnist1d", "mnist1d_cnn", "adam_1e-3", batch=100, epochs=40),
    # Trained to its plateau (plain Keras: 0.948-0.962 over the last 10 epochs), so that
    # its final does not depend on where the fit stops.
    "mnist1d16k_cnn": Setup("mnist1d16k", "mnist1d_cnn", "adam_4e-3", batch=100, epochs=30),
}


def load_data(name):
    """`((x, y), (x_test, y_test))` of a setup's data set."""
    import tf_asgd

    if name == "mnist1d":
        return tf_asgd.data.load_mnist1d()
    if name == "mnist1d16k":
        return tf_asgd.data.load_mnist1d(num_train=16000)
    if name == "mnist1d64k":
        return tf_asgd.data.load_mnist1d(num_train=64000, num_test=2000)
    if name == "digits":
        return tf_asgd.data.load_digits()
    if name == "digits32":
        return tf_asgd.data.load_digits_images(32)
    if name == "lookup64":
        return tf_asgd.data.load_lookup_sequences(vocab=64)
    raise ValueError(f"Unknown data set {name!r}.")


def make_optimizer(name, steps=None, scale=1.0):
    """A fresh Keras optimizer of a setup at `scale` times its rate: `sgd_0.05_m0.9`,
    `sgd_resnet`, `KIND_RATE` (`adam_1e-3`: Adam at rate 1e-3; also adamw, rmsprop, lion
    and nadam), or `adamw_cosine_RATE` (warm-up over 10% of the fit's `steps` to RATE,
    then Keras's `CosineDecay` over `steps` more, 2.5% of RATE at the fit's last step, as a
    user sets it for the `fit` they plan)."""
    import keras

    if name == "sgd_0.05_m0.9":
        return keras.optimizers.SGD(0.05 * scale, momentum=0.9)
    if name == "sgd_resnet":
        # He et al.'s CIFAR recipe (momentum 0.9, weight decay 5e-4) at the
        # rate for batch 32, without its step decay.
        return keras.optimizers.SGD(0.05 * scale, momentum=0.9, nesterov=True, weight_decay=5e-4)
    if name.startswith("adamw_cosine_"):
        if not steps:
            raise ValueError(f"{name!r} needs the fit's steps.")
        schedule = keras.optimizers.schedules.CosineDecay(
            0.0,
            steps,
            warmup_target=float(name.rsplit("_", 1)[1]) * scale,
            warmup_steps=max(1, steps // 10),
        )
        return keras.optimizers.AdamW(schedule)
    kind, _, rate = name.partition("_")
    kinds = {k.lower(): k for k in ("Adam", "AdamW", "RMSprop", "Lion", "Nadam")}
    if kind in kinds and rate:
        return getattr(keras.optimizers, kinds[kind])(float(rate) * scale)
    raise ValueError(f"Unknown optimizer {name!r}.")


def auto_worker_rate(name, synchronous=False):
    """The rule the strategy's `lr_scaling="auto"` resolves to for optimizer `name` where the
    PS averages the pushes (or in synchronous rounds), as in `AsyncParameterServerStrategy`."""
    from tf_asgd.runtime import optimizer_options

    # The kind and the rate's type decide it, not the schedule's length.
    return optimizer_options.auto_worker_rate(make_optimizer(name, steps=1), synchronous)


def build_model(name, data):
    """A fresh `tf_asgd.models` model for the data's input shape."""
    import inspect

    import tf_asgd

    builder = getattr(tf_asgd.models, name)
    if name == "causal_decoder":
        (x, y), _ = data
        tokens = int(max(x.max(), y.max())) + 1
        return builder(x.shape[1], y.shape[1], vocab=tokens, classes=tokens)
    if "input_shape" in inspect.signature(builder).parameters:
        return builder(input_shape=data[0][0].shape[1:])
    return builder()


def train_dataset(data, batch_size, seed):
    """The shuffled training batches (reshuffled every pass, the same order
    on every worker, so that `shard` gives them disjoint batches)."""
    import tensorflow as tf

    (x, y), _ = data
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=seed)
        .batch(batch_size, drop_remainder=True)
    )


class HeldOut:
    """Held-out accuracy and loss of a model's weights, on a plain Keras twin
    of the model on the chief (one forward pass over the whole set); per token where the
    model predicts a sequence."""

    def __init__(self, model_name, data):
        import tensorflow as tf

        _, (x_test, y_test) = data
        self.twin = build_model(model_name, data)
        self.x = tf.constant(x_test)
        self.y = np.asarray(y_test).reshape(-1)
        self._forward = tf.function(lambda x: self.twin(x, training=False))

    def __call__(self, weights):
        self.twin.set_weights(weights)
        logits = self._forward(self.x).numpy().astype(np.float64)
        logits = logits.reshape(-1, logits.shape[-1])
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        loss = -log_p[np.arange(len(self.y)), self.y].mean()
        return float((logits.argmax(axis=1) == self.y).mean()), float(loss)
