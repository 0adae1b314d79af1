"""Model builders for the papers' setups (plain Keras 3 models).

Each builder returns a new, uncompiled `keras.Model` whose last layer gives logits
(compile with `from_logits=True`). Build it under `strategy.scope()` to train it with
`AsyncParameterServerStrategy`.

Example:
    with strategy.scope():
        model = tf_asgd.models.digits_convnet()
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
"""

import keras


def digits_convnet(num_classes=10):
    """A small convnet for the 8x8 digits images (`tf_asgd.data.load_digits`).

    conv 16x3x3, conv 32x3x3 ("same" padding, ReLU), max-pool 2, dense 64
    (ReLU), dense `num_classes` (logits).

    Args:
        num_classes: outputs (logits).

    Returns:
        A `keras.Sequential` named "digits_convnet", for `(8, 8, 1)` inputs.

    Examples:
        >>> digits_convnet().count_params()
        38282
    """
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(num_classes),
        ],
        name="digits_convnet",
    )


def gem_mnist_convnet(input_shape=(28, 28, 1), num_classes=10):
    """The GEM paper's MNIST convnet (its code's `Model`, 163,790 parameters).

    conv 10x5x5, max-pool 2, conv 20x5x5, max-pool 2, dense 300, 200 (ReLU
    throughout), dense `num_classes` (logits). The paper's code also drops
    channels after the second conv (`Dropout2d`); left out here, so that
    throughput benchmarks time the same work every step.

    Args:
        input_shape: `(height, width, channels)`; MNIST's by default
            (`tf_asgd.data.load_mnist`).
        num_classes: outputs (logits).

    Returns:
        A `keras.Sequential` named "gem_mnist_convnet".
    """
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Conv2D(10, 5, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(20, 5, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(300, activation="relu"),
            keras.layers.Dense(200, activation="relu"),
            keras.layers.Dense(num_classes),
        ],
        name="gem_mnist_convnet",
    )


@keras.saving.register_keras_serializable(package="tf_asgd")
class LocalResponseNormalization(keras.layers.Layer):
    """cuda-convnet's response normalisation across channels.

    The layer form of `tf.nn.local_response_normalization` (same arguments and
    defaults but `alpha`); serializable (`keras.saving`, package "tf_asgd").

    Args:
        depth_radius: half-width of the channel window.
        bias: the offset added before the power.
        alpha: the scale of the sum of squares.
        beta: the exponent.
        **kwargs: `keras.layers.Layer`'s arguments (`name`, `dtype`, ...).

    Example:

    ```python
    x = tf_asgd.models.LocalResponseNormalization(depth_radius=2, bias=2.0, alpha=1e-4)(x)
    ```
    """

    def __init__(self, depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, **kwargs):
        super().__init__(**kwargs)
        self.depth_radius, self.bias, self.alpha, self.beta = depth_radius, bias, alpha, beta

    def call(self, x):
        """Normalises `x`, a `[batch, height, width, channels]` tensor, across channels.

        Args:
            x: the input tensor (4-D).

        Returns:
            A tensor of the same shape and dtype.
        """
        import tensorflow as tf

        return tf.nn.local_response_normalization(
            x, depth_radius=self.depth_radius, bias=self.bias, alpha=self.alpha, beta=self.beta
        )

    def get_config(self):
        """The layer's config, with its four normalisation arguments.

        Returns:
            A dict that `from_config` rebuilds the layer from.
        """
        return {
            **super().get_config(),
            "depth_radius": self.depth_radius,
            "bias": self.bias,
            "alpha": self.alpha,
            "beta": self.beta,
        }


def cuda_convnet_cifar10(input_shape=(24, 24, 3), num_classes=10):
    """Krizhevsky's cuda-convnet CIFAR-10 net (layers-18pct.cfg).

    conv 32x5x5 - maxpool 3/2 - LRN, conv 32x5x5 - avgpool 3/2 - LRN,
    conv 64x5x5 - avgpool 3/2, dense `num_classes`; ReLU after each conv.
    Trained on random 24x24 crops of the 32x32 images
    (`tf_asgd.data.random_crop_flip`); inputs are uint8-range pixels (0..255),
    rescaled by the model.

    Args:
        input_shape: `(height, width, channels)`; the crops' by default.
        num_classes: outputs (logits).

    Returns:
        A `keras.Sequential` named "cuda_convnet_cifar10".
    """
    L = keras.layers
    return keras.Sequential(
        [
            keras.Input(input_shape),
            L.Rescaling(1.0 / 255),
            L.Conv2D(32, 5, padding="same", activation="relu"),
            L.MaxPooling2D(3, strides=2, padding="same"),
            LocalResponseNormalization(depth_radius=1, alpha=5e-5 * 3),
            L.Conv2D(32, 5, padding="same", activation="relu"),
            L.AveragePooling2D(3, strides=2, padding="same"),
            LocalResponseNormalization(depth_radius=1, alpha=5e-5 * 3),
            L.Conv2D(64, 5, padding="same", activation="relu"),
            L.AveragePooling2D(3, strides=2, padding="same"),
            L.Flatten(),
            L.Dense(num_classes),
        ],
        name="cuda_convnet_cifar10",
    )


def paine2013_imagenet_convnet(input_shape=(224, 224, 3), num_classes=1000, dropout=0.5):
    """The large ImageNet convnet of GPU A-SGD (Paine et al. 2013).

    The paper trained Krizhevsky et al.'s 2012 architecture with cuda-convnet:
    five conv layers (96x11x11/4, 256x5x5, 384x3x3, 384x3x3, 256x3x3) with
    ReLU, response normalisation and overlapping 3/2 max-pooling, then two
    4096-unit ReLU layers with dropout and a `num_classes` output (logits).
    Inputs are pixels 0..255 (`tf_asgd.data.imagenet_dataset`), rescaled by the model.

    Args:
        input_shape: `(height, width, channels)`.
        num_classes: outputs (logits).
        dropout: the rate of both dropout layers.

    Returns:
        A `keras.Sequential` named "paine2013_imagenet_convnet".
    """
    L = keras.layers
    return keras.Sequential(
        [
            keras.Input(input_shape),
            L.Rescaling(1.0 / 255),
            L.Conv2D(96, 11, strides=4, padding="same", activation="relu"),
            LocalResponseNormalization(depth_radius=2, bias=2.0, alpha=1e-4, beta=0.75),
            L.MaxPooling2D(3, strides=2),
            L.Conv2D(256, 5, padding="same", activation="relu"),
            LocalResponseNormalization(depth_radius=2, bias=2.0, alpha=1e-4, beta=0.75),
            L.MaxPooling2D(3, strides=2),
            L.Conv2D(384, 3, padding="same", activation="relu"),
            L.Conv2D(384, 3, padding="same", activation="relu"),
            L.Conv2D(256, 3, padding="same", activation="relu"),
            L.MaxPooling2D(3, strides=2),
            L.Flatten(),
            L.Dense(4096, activation="relu"),
            L.Dropout(dropout),
            L.Dense(4096, activation="relu"),
            L.Dropout(dropout),
            L.Dense(num_classes),
        ],
        name="paine2013_imagenet_convnet",
    )


def mnist1d_cnn(input_shape=(40, 1), num_classes=10, channels=25):
    """The MNIST-1D paper's 1D convnet (Greydanus 2020, `ConvBase`; 5,210 parameters).

    Three `Conv1D` of `channels` filters (kernels 5, 3, 3; stride 2, "same"
    padding; ReLU), Flatten, Dense `num_classes` (logits).

    Args:
        input_shape: `(length, channels)`; `tf_asgd.data.load_mnist1d`'s
            `(40, 1)` signals by default.
        num_classes: outputs (logits).
        channels: filters of each `Conv1D`.

    Returns:
        A `keras.Sequential` named "mnist1d_cnn".

    Examples:
        >>> mnist1d_cnn().count_params()
        5210
    """
    L = keras.layers
    return keras.Sequential(
        [
            keras.Input(input_shape),
            L.Conv1D(channels, 5, strides=2, padding="same", activation="relu"),
            L.Conv1D(channels, 3, strides=2, padding="same", activation="relu"),
            L.Conv1D(channels, 3, strides=2, padding="same", activation="relu"),
            L.Flatten(),
            L.Dense(num_classes),
        ],
        name="mnist1d_cnn",
    )


def _residual_block(x, filters, strides, name):
    """He et al.'s basic block: 3x3 conv, BN, ReLU, 3x3 conv, BN, added to the
    input (through a strided 1x1 conv and BN where the shape changes), ReLU."""
    L = keras.layers
    shortcut = x
    y = L.Conv2D(filters, 3, strides=strides, padding="same", use_bias=False, name=f"{name}_conv1")(
        x
    )
    y = L.BatchNormalization(name=f"{name}_bn1")(y)
    y = L.ReLU(name=f"{name}_relu1")(y)
    y = L.Conv2D(filters, 3, padding="same", use_bias=False, name=f"{name}_conv2")(y)
    y = L.BatchNormalization(name=f"{name}_bn2")(y)
    if strides != 1 or x.shape[-1] != filters:
        shortcut = L.Conv2D(filters, 1, strides=strides, use_bias=False, name=f"{name}_proj")(x)
        shortcut = L.BatchNormalization(name=f"{name}_proj_bn")(shortcut)
    return L.ReLU(name=f"{name}_out")(L.Add(name=f"{name}_add")([y, shortcut]))


def resnet_bn(
    input_shape=(32, 32, 3),
    num_classes=10,
    widths=(32, 64, 128),
    blocks_per_stage=1,
    stem_strides=2,
):
    """A small ResNet with batch normalisation (He et al. 2016's CIFAR design, shallower).

    A 3x3 conv stem (BN, ReLU), then one stage per entry of `widths`, each
    of `blocks_per_stage` basic residual blocks, every stage after the first
    halving the resolution; global average pooling and a Dense `num_classes`
    (logits). The defaults (309,994 parameters, 32x32x3 inputs such as
    `tf_asgd.data.load_digits_images()`) put the stem at stride 2, so that
    the 3x3 convs run at 16, 8 and 4 pixels square: less compute per step
    than at full resolution, for the same parameters.

    Args:
        input_shape: `(height, width, channels)`.
        num_classes: outputs (logits).
        widths: filters of each stage.
        blocks_per_stage: residual blocks per stage.
        stem_strides: the stem conv's stride (1: full resolution).

    Returns:
        A functional `keras.Model` named "resnet_bn".

    Examples:
        >>> resnet_bn().count_params()
        309994
    """
    L = keras.layers
    inputs = keras.Input(input_shape)
    x = L.Conv2D(
        widths[0], 3, strides=stem_strides, padding="same", use_bias=False, name="stem_conv"
    )(inputs)
    x = L.BatchNormalization(name="stem_bn")(x)
    x = L.ReLU(name="stem_relu")(x)
    for stage, filters in enumerate(widths):
        for block in range(blocks_per_stage):
            strides = 2 if stage > 0 and block == 0 else 1
            x = _residual_block(x, filters, strides, f"stage{stage + 1}_block{block + 1}")
    x = L.GlobalAveragePooling2D(name="pool")(x)
    outputs = L.Dense(num_classes, name="logits")(x)
    return keras.Model(inputs, outputs, name="resnet_bn")


@keras.saving.register_keras_serializable(package="tf_asgd")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to a `(batch, length, width)` input."""

    def build(self, input_shape):
        self.positions = self.add_weight(
            shape=tuple(input_shape[1:]), initializer="random_normal", name="positions"
        )

    def call(self, x):
        return x + self.positions


def mnist1d_transformer(input_shape=(40, 1), num_classes=10, width=64, heads=4, blocks=2):
    """A small Transformer encoder over MNIST-1D's signals: a second model family
    (attention and LayerNorm, no convolution stack) for the benchmarks.

    A width-`width` `Conv1D` (kernel 3) embeds each position, `PositionEmbedding`
    adds learned positions, then `blocks` post-norm encoder blocks (`heads`-head
    self-attention, a GELU MLP of `2 * width`, each added back and
    `LayerNormalization`ed), global average pooling and Dense logits.

    Args:
        input_shape: `(length, channels)`; `tf_asgd.data.load_mnist1d`'s `(40, 1)`.
        num_classes: outputs (logits).
        width: the embedding width.
        heads: attention heads of each block (`width // heads` per head).
        blocks: encoder blocks.

    Returns:
        A functional `keras.Model` named "mnist1d_transformer".

    Examples:
        >>> mnist1d_transformer().count_params()
        70410
    """
    L = keras.layers
    inputs = keras.Input(input_shape)
    x = PositionEmbedding(name="positions")(
        L.Conv1D(width, 3, padding="same", name="embed")(inputs)
    )
    for b in range(blocks):
        attended = L.MultiHeadAttention(heads, width // heads, name=f"block{b + 1}_attention")(x, x)
        x = L.LayerNormalization(name=f"block{b + 1}_norm1")(x + attended)
        hidden = L.Dense(2 * width, activation="gelu", name=f"block{b + 1}_mlp1")(x)
        x = L.LayerNormalization(name=f"block{b + 1}_norm2")(
            x + L.Dense(width, name=f"block{b + 1}_mlp2")(hidden)
        )
    x = L.GlobalAveragePooling1D(name="pool")(x)
    return keras.Model(inputs, L.Dense(num_classes, name="logits")(x), name="mnist1d_transformer")


def causal_decoder(
    length, outputs, vocab, classes, width=64, heads=4, blocks=2, name="causal_decoder"
):
    """A small GPT-style decoder: causal self-attention over tokens, a third model family
    for the benchmarks (sequence outputs, pre-norm blocks, no convolution).

    Token and learned position embeddings of width `width`, then `blocks` pre-norm
    blocks (`heads`-head self-attention with a causal mask, a GELU MLP of `4 * width`,
    each added back), a final `LayerNormalization` and Dense logits for the last
    `outputs` positions (`data.load_lookup_sequences`'s targets).

    Args:
        length: tokens in a sequence.
        outputs: trailing positions whose logits the model returns.
        vocab: input tokens (embedding rows).
        classes: logits per position.
        width: the embedding width.
        heads: attention heads of each block.
        blocks: decoder blocks.
        name: the model's name.

    Returns:
        A functional `keras.Model` from `(batch, length)` tokens to
        `(batch, outputs, classes)` logits.

    Examples:
        >>> causal_decoder(23, 21, vocab=32, classes=32).output_shape
        (None, 21, 32)
    """
    L = keras.layers
    inputs = keras.Input((length,), dtype="int32")
    x = PositionEmbedding(name="positions")(L.Embedding(vocab, width, name="embed")(inputs))
    for b in range(blocks):
        h = L.LayerNormalization(name=f"block{b + 1}_norm1")(x)
        attention = L.MultiHeadAttention(heads, width // heads, name=f"block{b + 1}_attention")
        x = x + attention(h, h, use_causal_mask=True)
        h = L.LayerNormalization(name=f"block{b + 1}_norm2")(x)
        h = L.Dense(4 * width, activation="gelu", name=f"block{b + 1}_mlp1")(h)
        x = x + L.Dense(width, name=f"block{b + 1}_mlp2")(h)
    x = L.LayerNormalization(name="final_norm")(x)
    logits = L.Dense(classes, name="logits")(x[:, length - outputs :, :])
    return keras.Model(inputs, logits, name=name)
