"""The launcher's input pipeline: a config's data set as tf.data pipelines.

`load_data_arrays(config)` reads the data from disk (failing fast with
`tf_asgd.data.MissingDataError` when it is absent); `make_data(config,
arrays)` turns it into a `Data` of batched train / test datasets;
`ten_crop_evaluate` is the multi-crop test of the ImageNet config.

```python
arrays = input_pipeline.load_data_arrays(config)  # before connecting to a cluster
...                                               # connect (create the strategy)
data = input_pipeline.make_data(config, arrays)   # after: datasets on the chief's new device
```

The readers and image ops themselves live in `tf_asgd.data`.
"""

import numpy as np
import tensorflow as tf

from tf_asgd import data
from tf_asgd.launch.config_fields import DATASETS

IMAGENET_TRAIN_IMAGES = 1_281_167  # ILSVRC 2012; TFRecords do not say how many they hold


class Data:
    """Datasets of a run: `train` (batched, finite), `test` (batched), sizes.

    Attributes:
        train: shuffled training batches (`drop_remainder=True`).
        test: test batches.
        steps_per_epoch: `config.steps_per_epoch`, else training examples // batch size.
        test_steps: `config.eval_steps`, or None for the whole test split.
        test_images: uncropped test batches for `ten_crop_evaluate`, or None.
    """

    def __init__(self, train, test, steps_per_epoch, test_steps=None, test_images=None):
        self.train, self.test = train, test
        self.steps_per_epoch, self.test_steps = steps_per_epoch, test_steps
        self.test_images = test_images


def load_data_arrays(config):
    """Loads `config.dataset` from disk (NumPy arrays; for imagenet checks the files).

    Raises `tf_asgd.data.MissingDataError` with the path tried when absent.
    Call before connecting to a cluster: tf.data datasets must be created
    after (`make_data`), since connecting changes the chief's device names.

    Returns:
        `((x, y), (x_test, y_test))` for digits, mnist and cifar10; None for
        imagenet (its files are read by the pipeline).
    """
    name = config.dataset
    if name not in DATASETS:
        raise ValueError(f"Unknown dataset {name!r}; expected one of {DATASETS}.")
    if name == "digits":
        return data.load_digits(seed=config.seed)
    if name == "mnist":
        return data.load_mnist(config.data_dir, download=config.download)
    if name == "cifar10":
        return data.load_cifar10(config.data_dir, download=config.download)
    for split in ("train", "val"):
        data.imagenet_dataset(config.data_dir, split, config.image_size or 256, config.seed)
    return None


def make_data(config, arrays=None):
    """`Data` (tf.data pipelines) for `config.dataset`; `arrays` from `load_data_arrays`."""
    name, bs, seed = config.dataset, config.batch_size, config.seed
    if arrays is None:
        arrays = load_data_arrays(config)

    def finish(train, n_train, test, test_images=None):
        steps = config.steps_per_epoch or max(1, n_train // bs)
        train = train.shuffle(min(n_train, 20_000), seed=seed)
        train = train.batch(bs, drop_remainder=True).prefetch(tf.data.AUTOTUNE)
        test = test.batch(bs).prefetch(tf.data.AUTOTUNE)
        if test_images is not None:
            test_images = test_images.batch(bs)
        return Data(train, test, steps, config.eval_steps or None, test_images)

    if name in ("digits", "mnist"):
        (x, y), (xt, yt) = arrays
        scale = 1.0 if name == "digits" else 1.0 / 255

        def prep(img, label):
            return tf.cast(img, tf.float32) * scale, label

        train = tf.data.Dataset.from_tensor_slices((x, y)).map(prep)
        test = tf.data.Dataset.from_tensor_slices((xt, yt)).map(prep)
        return finish(train, len(x), test)
    if name == "cifar10":
        (x, y), (xt, yt) = arrays
        crop = config.crop_size or 32

        def train_prep(img, label):
            img = tf.cast(img, tf.float32)
            if config.augment:
                return data.random_crop_flip(img, crop), label
            return data.center_crop(img, crop), label

        def test_prep(img, label):
            return data.center_crop(tf.cast(img, tf.float32), crop), label

        train = tf.data.Dataset.from_tensor_slices((x, y)).map(train_prep)
        test = tf.data.Dataset.from_tensor_slices((xt, yt)).map(test_prep)
        return finish(train, len(x), test)
    # imagenet
    size, crop = config.image_size or 256, config.crop_size or 224
    train, n_train = data.imagenet_dataset(config.data_dir, "train", size, seed)
    val, _ = data.imagenet_dataset(config.data_dir, "val", size, seed)
    if config.augment:
        train = train.map(lambda i, lab: (data.random_crop_flip(i, crop), lab), tf.data.AUTOTUNE)
    else:
        train = train.map(lambda i, lab: (data.center_crop(i, crop), lab), tf.data.AUTOTUNE)
    if n_train < 0:
        n_train = IMAGENET_TRAIN_IMAGES
    test = val.map(lambda i, lab: (data.center_crop(i, crop), lab), tf.data.AUTOTUNE)
    return finish(train, n_train, test, test_images=val if config.ten_crop_eval else None)


def ten_crop_evaluate(model, images, crop_size, steps=None):
    """Multi-crop test accuracy: softmax averaged over `data.ten_crops` views.

    Args:
        model: a Keras classifier returning logits.
        images: batches `(x [B, H, W, C], y [B])` of uncropped images.
        crop_size: side of each view.
        steps: batches to evaluate (None: all).

    Returns:
        `{"ten_crop_accuracy": top-1, "ten_crop_top5_accuracy": top-5}`.
    """
    correct1 = correct5 = total = 0
    for i, (x, y) in enumerate(images):
        if steps and i >= steps:
            break
        views = data.ten_crops(x, crop_size)  # [10, B, c, c, C]
        b = tf.shape(x)[0]
        flat = tf.reshape(views, tf.concat([[-1], tf.shape(views)[2:]], 0))
        probs = tf.nn.softmax(model(flat, training=False))
        probs = tf.reduce_mean(tf.reshape(probs, [10, b, -1]), axis=0).numpy()
        y = np.asarray(y)
        k = min(5, probs.shape[-1])
        top = np.argsort(-probs, axis=-1)[:, :k]
        correct1 += int((top[:, 0] == y).sum())
        correct5 += int((top == y[:, None]).any(axis=1).sum())
        total += len(y)
    return {
        "ten_crop_accuracy": correct1 / max(total, 1),
        "ten_crop_top5_accuracy": correct5 / max(total, 1),
    }
