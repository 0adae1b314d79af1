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
    """The GEM paper's MNIST convnet: conv 10x5x5, conv 20x5x5, dense 300, 200, 10."""
    return keras.Sequential(
        [
            keras.Input(input_shape),
            keras.layers.Conv2D(10, 5, activation="relu"),
            keras.layers.Conv2D(20, 5, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(300, activation="relu"),
            keras.layers.Dense(200, activation="relu"),
            keras.layers.Dense(num_classes),
        ],
        name="gem_mnist_convnet",
    )
