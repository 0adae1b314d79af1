"""Model builders for the papers' setups (plain Keras 3 models)."""

import keras


def digits_convnet(num_classes=10):
    """A small convnet for the 8x8 digits images."""
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
    """The GEM paper's MNIST convnet (its code's `Model`, 163,790 parameters):
    conv 10x5x5, max-pool 2, conv 20x5x5, max-pool 2, dense 300, 200, 10.

    The paper's code also drops channels after the second conv (`Dropout2d`);
    left out here, so that throughput benchmarks time the same work every step.
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
    """cuda-convnet's response normalisation across channels (`tf.nn.local_response_normalization`)."""

    def __init__(self, depth_radius=4, bias=1.0, alpha=0.001 / 9.0, beta=0.75, **kwargs):
        super().__init__(**kwargs)
        self.depth_radius, self.bias, self.alpha, self.beta = depth_radius, bias, alpha, beta

    def call(self, x):
        import tensorflow as tf

        return tf.nn.local_response_normalization(
            x, depth_radius=self.depth_radius, bias=self.bias, alpha=self.alpha, beta=self.beta
        )

    def get_config(self):
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
    Trained on random 24x24 crops of the 32x32 images.
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
