"""Data sets that work offline.

`load_digits` is scikit-learn's 8x8 handwritten digits (1,797 images, shipped
inside the package), the offline default of the tests and the launcher;
`load_digits_images` the same images upsampled to RGB squares (for convnets
built for CIFAR-sized inputs). `load_mnist1d` generates MNIST-1D (Greydanus
2020) on this machine with the `mnist1d` package; `load_lookup_sequences` a
synthetic language-modelling task for causal decoders.
`emulated_device_time` makes workers behave like GPUs of a given speed on a
CPU-only machine (benchmarks, stragglers).
"""

import os

import numpy as np

from tf_asgd.errors import MissingDataError


def load_digits(test_fraction=0.2, seed=0):
    """scikit-learn's 8x8 handwritten digits, shuffled and split; works offline.

    Args:
        test_fraction: share of the 1,797 images held out (0.2: 359 of them).
        seed: seed of the shuffle before the split (the same seed, the same split).

    Returns:
        `((x_train, y_train), (x_test, y_test))`: float32 images in [0, 1] of
        shape `(n, 8, 8, 1)`, int64 labels 0..9.

    Raises:
        ImportError: scikit-learn (which ships the data set) is not installed.

    Examples:
        >>> (x, y), (x_test, y_test) = load_digits()
        >>> x.shape, x.dtype, y.dtype, len(x_test)
        ((1438, 8, 8, 1), dtype('float32'), dtype('int64'), 359)
    """
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:
        raise ImportError(
            "The digits data set ships with scikit-learn: pip install scikit-learn"
        ) from e
    digits = sk_load_digits()
    x = (digits.images / 16.0).astype("float32")[..., None]
    y = digits.target.astype("int64")
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = int(round(len(x) * test_fraction))
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def load_digits_images(size=32, channels=3, test_fraction=0.2, seed=0):
    """The digits of `load_digits` upsampled to `size` x `size` x `channels`.

    Bilinear upsampling of the 8x8 images, the grey level copied to every
    channel; the same split as `load_digits(test_fraction, seed)`.

    Args:
        size: side of the square images (at least 8).
        channels: copies of the grey channel (3: RGB-shaped inputs).
        test_fraction: share of the 1,797 images held out.
        seed: the shuffle before the split.

    Returns:
        `((x_train, y_train), (x_test, y_test))`: float32 images in [0, 1] of
        shape `(n, size, size, channels)`, int64 labels.

    Raises:
        ValueError: `size` below 8 or `channels` below 1 (or not integers).
        ImportError: scikit-learn is not installed (see `load_digits`).

    Example:

    ```python
    (x, y), (x_test, y_test) = tf_asgd.data.load_digits_images(32)
    model = tf_asgd.models.resnet_bn(input_shape=x.shape[1:])
    ```
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 8:
        raise ValueError(f"size must be an integer >= 8, got {size!r}.")
    if isinstance(channels, bool) or not isinstance(channels, int) or channels < 1:
        raise ValueError(f"channels must be an integer >= 1, got {channels!r}.")
    import tensorflow as tf

    def grow(x):
        x = tf.image.resize(x, [size, size], method="bilinear").numpy()
        return np.repeat(np.clip(x, 0.0, 1.0), channels, axis=-1).astype("float32")

    (x, y), (xt, yt) = load_digits(test_fraction, seed)
    return (grow(x), y), (grow(xt), yt)


def load_mnist1d(num_train=4000, num_test=1000, seed=42):
    """MNIST-1D (Greydanus 2020), generated here: no download.

    Built with the `mnist1d` package's generator (`mnist1d.data.make_dataset`,
    its default transformation arguments), never its `get_dataset`, which
    downloads a pickle. The defaults (4,000 + 1,000 examples, seed 42) give
    exactly the package's standard arrays (`make_dataset(get_dataset_args())`).
    Other sizes draw a new set from the same generator (the generator makes
    `(num_train + num_test) // 10` examples per class, shuffles them, and
    standardises the whole set): the held-out examples then differ too.
    The generator seeds Python's and NumPy's global random state; both are
    restored afterwards.

    Args:
        num_train: training examples (e.g. 16000 for a larger set).
        num_test: held-out examples; `num_train + num_test` must be a multiple
            of 10 (equal classes).
        seed: the generator's seed (42: the package's standard set).

    Returns:
        `((x_train, y_train), (x_test, y_test))`: float32 signals of shape
        `(n, 40, 1)` (a channel axis for `Conv1D`), int64 labels 0..9.

    Raises:
        ImportError: the `mnist1d` package is not installed.
        ValueError: sizes that are not positive integers, or a total that is
            not a multiple of 10.

    Example:

    ```python
    (x, y), (x_test, y_test) = tf_asgd.data.load_mnist1d()  # x: (4000, 40, 1)
    model = tf_asgd.models.mnist1d_cnn()
    ```
    """
    for name, n in (("num_train", num_train), ("num_test", num_test)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{name} must be a positive integer, got {n!r}.")
    if (num_train + num_test) % 10:
        raise ValueError(
            f"num_train + num_test must be a multiple of 10 (the generator makes equal classes), "
            f"got {num_train} + {num_test}."
        )
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as e:
        raise ImportError(
            "MNIST-1D is generated by the mnist1d package: pip install mnist1d "
            "(part of tf_asgd's test and bench extras)"
        ) from e
    import random

    args = get_dataset_args()
    args.num_samples = num_train + num_test
    args.train_split = 1.0  # split here, by count: the generator's split is by float fraction
    args.seed = seed
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        d = make_dataset(args)
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    x = np.asarray(d["x"], "float32")[..., None]
    y = np.asarray(d["y"], "int64")
    return (x[:num_train], y[:num_train]), (x[num_train:], y[num_train:])


def load_lookup_sequences(
    num_train=32000, num_test=2000, length=24, vocab=32, lags=(1, 3), noise=0.1, seed=0
):
    """A synthetic language-modelling task for causal decoders: a hidden lookup table.

    Each sequence starts with `max(lags)` random tokens (0 to `vocab - 1`); every later
    token is a fixed random table's entry for the tokens `lags` positions back (with
    `(1, 3)`: the previous token and the one three back), or, with probability `noise`,
    a uniform draw. A decoder predicts each next token from the ones before it (teacher
    forcing); only the tokens the table sets are targets. The best accuracy is about
    `1 - noise + noise / vocab`, reached by learning the table and where to look.

    Args:
        num_train: training sequences.
        num_test: held-out sequences (the same table).
        length: tokens in a sequence.
        vocab: distinct tokens.
        lags: how far back the table looks.
        noise: the share of tokens drawn uniformly instead.
        seed: NumPy's seed for the table and the draw.

    Returns:
        `((x_train, y_train), (x_test, y_test))`: int32 inputs of shape
        `(n, length - 1)` and int64 targets of shape `(n, length - max(lags))`, the next
        token at each of the inputs' last `length - max(lags)` positions.

    Example:

    ```python
    (x, y), _ = tf_asgd.data.load_lookup_sequences()  # x: (32000, 23), y: (32000, 21)
    model = tf_asgd.models.causal_decoder(x.shape[1], y.shape[1], vocab=32, classes=32)
    ```
    """
    for name, n in (("num_train", num_train), ("num_test", num_test), ("length", length)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{name} must be a positive integer, got {n!r}.")
    first = max(lags)
    if length <= first + 1 or min(lags) < 1:
        raise ValueError(f"length must exceed max(lags) + 1 and lags be >= 1, got {length}.")
    rng = np.random.default_rng(seed)
    table = rng.integers(0, vocab, size=(vocab,) * len(lags))
    n = num_train + num_test
    seq = rng.integers(0, vocab, size=(n, length))
    uniform = rng.random((n, length)) < noise
    for t in range(first, length):
        looked_up = table[tuple(seq[:, t - lag] for lag in lags)]
        seq[:, t] = np.where(uniform[:, t], seq[:, t], looked_up)
    x, y = seq[:, :-1].astype("int32"), seq[:, first:].astype("int64")
    return (x[:num_train], y[:num_train]), (x[num_train:], y[num_train:])


# ---------------------------------------------------------------------------
# Emulated device time: a GPU step costs the worker time but no CPU. On a CPU
# machine it is emulated by tf.data's per-element sleep, so benchmarks and the
# straggler test can run many "GPU" workers on two cores.


def sleep_transformation(micros):
    """tf.data's per-element sleep (no CPU used), for `Dataset.apply`.

    The op is TF's `SleepDataset` (`tf.raw_ops.SleepDataset`; the Python wrapper
    around it is internal): a TF without it gets a clear error, not a silent no-op.

    Args:
        micros: microseconds each element is delayed, a Python number or an
            int64 scalar tensor.

    Returns:
        A function `dataset -> dataset` with the same `element_spec`.

    Raises:
        RuntimeError: this TensorFlow has no `tf.raw_ops.SleepDataset`.

    Example:

    ```python
    dataset = dataset.apply(tf_asgd.data.sleep_transformation(20_000))  # 20 ms each
    ```
    """
    import tensorflow as tf

    from tf_asgd import internals

    if not hasattr(tf.raw_ops, "SleepDataset"):
        raise RuntimeError(
            "This TensorFlow has no tf.raw_ops.SleepDataset; emulated device time is unavailable."
        )
    if isinstance(micros, (int, float)):
        micros = int(micros)

    def apply(dataset):
        spec = dataset.element_spec
        flat = internals.flat_tensor_specs(spec)
        variant = tf.raw_ops.SleepDataset(
            input_dataset=tf.data.experimental.to_variant(dataset),
            sleep_microseconds=tf.cast(micros, tf.int64),
            output_types=[s.dtype for s in flat],
            output_shapes=[s.shape for s in flat],
        )
        return tf.data.experimental.from_variant(variant, spec)

    return apply


def emulated_device_time(step_ms, slowdown=None):
    """A `per_worker_dataset_fn` that delays every batch by `step_ms` on each worker.

    Makes workers on a CPU-only machine behave like devices of a given speed: the
    delay is a sleep in tf.data (`sleep_transformation`), which costs no CPU.

    Args:
        step_ms: milliseconds each batch is delayed, a number >= 0.
        slowdown: a dict mapping worker indices to factors of `step_ms`:
            `{1: 10.0}` makes worker 1 a straggler whose batches take 10x as
            long. `None`: every worker is delayed by `step_ms`.

    Returns:
        A function `(dataset, worker_index) -> dataset`, to pass as
        `AsyncParameterServerStrategy(..., per_worker_dataset_fn=...)`.

    Raises:
        ValueError: `step_ms` is not a number >= 0, a `slowdown` key is not a
            worker index >= 0, or a factor is not a number > 0.

    Example:

    ```python
    strategy = tf_asgd.AsyncParameterServerStrategy(
        cluster.resolver, n_sync=10,
        per_worker_dataset_fn=tf_asgd.data.emulated_device_time(20, {1: 10.0}))
    ```
    """
    if isinstance(step_ms, bool) or not isinstance(step_ms, (int, float)) or step_ms < 0:
        raise ValueError(f"step_ms must be a number >= 0, got {step_ms!r}.")
    slowdown = dict(slowdown or {})
    for index, factor in slowdown.items():
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"slowdown keys must be worker indices >= 0, got {index!r}.")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise ValueError(f"slowdown[{index}] must be a number > 0, got {factor!r}.")
    # Worker i's factor is factors[min(i, last)]; the last entry (1.0) covers
    # every worker not named.
    factors = [float(slowdown.get(i, 1.0)) for i in range(max(slowdown, default=-1) + 1)] + [1.0]

    def per_worker_dataset_fn(dataset, worker_index):
        import tensorflow as tf

        index = tf.minimum(tf.cast(worker_index, tf.int64), len(factors) - 1)
        factor = tf.gather(tf.constant(factors, tf.float64), index)
        micros = tf.cast(tf.round(step_ms * 1000.0 * factor), tf.int64)
        return dataset.apply(sleep_transformation(micros))

    return per_worker_dataset_fn


# ---------------------------------------------------------------------------
# Larger data sets for the launcher's configs (tf_asgd.launch.input_pipeline). Loaded with
# the ecosystem's readers (keras.datasets, keras.utils.image_dataset_from_directory,
# tf.data TFRecords); a missing data set raises `MissingDataError` naming the
# path tried and how to get the data.


def _keras_cache(name):
    return os.path.join(
        os.environ.get("KERAS_HOME", os.path.join(os.path.expanduser("~"), ".keras")),
        "datasets",
        name,
    )


def _mnist_file(path):
    return path or _keras_cache("mnist.npz")


def _cifar10_dir(data_dir):
    return data_dir or _keras_cache(
        os.path.join("cifar-10-batches-py-target", "cifar-10-batches-py")
    )


def needs_download(dataset, data_dir=""):
    """Whether loading `dataset` would download it (it is not on this machine).

    Args:
        dataset: the data set's name: "mnist", "cifar10" (others are never
            downloaded: "digits" ships with scikit-learn, ImageNet must be there).
        data_dir: where the launcher's config says it is; "" means Keras's cache
            (`~/.keras/datasets`).

    Returns:
        True where `load_mnist` or `load_cifar10` would download it.
    """
    if dataset == "mnist":
        return not os.path.isfile(_mnist_file(data_dir))
    if dataset == "cifar10":
        return not os.path.isfile(os.path.join(_cifar10_dir(data_dir), "data_batch_1"))
    return False  # digits ship with scikit-learn; imagenet is never downloaded


def load_mnist(path="", download=True):
    """MNIST from a Keras-format `mnist.npz`, downloaded by Keras where allowed.

    Args:
        path: a Keras-format `mnist.npz` (arrays `x_train`, `y_train`,
            `x_test`, `y_test`); "" means `~/.keras/datasets/mnist.npz`
            (under `KERAS_HOME` where set).
        download: where `path` is "" and the file is missing, download it with
            `keras.datasets.mnist.load_data()`.

    Returns:
        `((x_train, y_train), (x_test, y_test))`: uint8 images of shape
        `(n, 28, 28, 1)`, int64 labels.

    Raises:
        MissingDataError: the file is not there (and was not to be downloaded,
            or the download failed); the message says how to get it.

    Example:

    ```python
    (x, y), (x_test, y_test) = tf_asgd.data.load_mnist()
    model = tf_asgd.models.gem_mnist_convnet()
    ```
    """
    tried = _mnist_file(path)
    if os.path.isfile(tried):
        with np.load(tried, allow_pickle=False) as f:
            xy = (f["x_train"], f["y_train"]), (f["x_test"], f["y_test"])
    elif path or not download:
        raise MissingDataError(
            f"MNIST not found at {tried!r}. Get it with "
            "`python -c 'import keras; keras.datasets.mnist.load_data()'` on a "
            "machine with network access (it writes ~/.keras/datasets/mnist.npz), "
            "then copy that file here or pass --config.data_dir=/path/to/mnist.npz."
        )
    else:
        import keras

        try:
            xy = keras.datasets.mnist.load_data()
        except Exception as e:  # no network, blocked proxy, ...
            raise MissingDataError(
                f"MNIST not found at {tried!r} and downloading it failed ({e}). "
                "Copy a Keras-format mnist.npz there or pass "
                "--config.data_dir=/path/to/mnist.npz."
            ) from e
    (x, y), (xt, yt) = xy
    return (x[..., None], y.astype("int64")), (xt[..., None], yt.astype("int64"))


# Only what rebuilds a NumPy array may be unpickled from a CIFAR batch file
# (numpy < 2 and >= 2 spellings): a tampered file cannot run code. Keras 3.15
# reads batches this way; Keras 3.13 and 3.14 use a plain `pickle.load`.
_CIFAR_PICKLE_GLOBALS = frozenset(
    {
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
    }
)


def load_cifar_batch(path):
    """One batch file of CIFAR-10's python version, read with a restricted unpickler.

    Only what rebuilds NumPy arrays may be unpickled, so a tampered file cannot
    run code.

    Args:
        path: a batch file (`data_batch_1`, ..., `test_batch`).

    Returns:
        `(data, labels)`: uint8 images of shape `(n, 3, 32, 32)` and the list
        of their labels.

    Raises:
        pickle.UnpicklingError: the file asks to unpickle anything else.
        OSError: the file cannot be read.
    """
    import pickle

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in _CIFAR_PICKLE_GLOBALS:
                return super().find_class(module, name)
            raise pickle.UnpicklingError(
                f"Refusing to unpickle {module}.{name} from CIFAR batch {path!r}: "
                "the file may be corrupt or malicious."
            )

    with open(path, "rb") as f:
        batch = {
            k.decode("utf8") if isinstance(k, bytes) else k: v
            for k, v in Unpickler(f, encoding="bytes").load().items()
        }
    data = batch["data"]
    return data.reshape(data.shape[0], 3, 32, 32), batch["labels"]


def load_cifar10(data_dir="", download=True):
    """CIFAR-10 from its python version's batch files, downloaded by Keras where allowed.

    Args:
        data_dir: the `cifar-10-batches-py` directory of the python version
            (`data_batch_1..5`, `test_batch`); "" means Keras's cache.
        download: where `data_dir` is "" and the files are missing, download
            them with `keras.datasets.cifar10.load_data()`.

    Returns:
        `((x_train, y_train), (x_test, y_test))`: uint8 images of shape
        `(n, 32, 32, 3)`, int64 labels of shape `(n,)`.

    Raises:
        MissingDataError: the files are not there (and were not to be
            downloaded, or the download failed); the message says how to get them.
        pickle.UnpicklingError: a batch file holds more than NumPy arrays
            (`load_cifar_batch`).

    Example:

    ```python
    (x, y), (x_test, y_test) = tf_asgd.data.load_cifar10()
    model = tf_asgd.models.cuda_convnet_cifar10()  # trained on 24x24 crops
    ```
    """
    tried = _cifar10_dir(data_dir)
    if os.path.isfile(os.path.join(tried, "data_batch_1")):
        xs, ys = zip(
            *(load_cifar_batch(os.path.join(tried, f"data_batch_{i}")) for i in range(1, 6))
        )
        x, y = np.concatenate(xs), np.concatenate(ys)
        xt, yt = load_cifar_batch(os.path.join(tried, "test_batch"))
        x, xt = x.transpose(0, 2, 3, 1), np.asarray(xt).transpose(0, 2, 3, 1)
    elif data_dir or not download:
        raise MissingDataError(
            f"CIFAR-10 not found at {tried!r} (expected data_batch_1..5 and "
            "test_batch). Get the python version from "
            "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz, extract it "
            "and pass --config.data_dir=/path/to/cifar-10-batches-py."
        )
    else:
        import keras

        try:
            (x, y), (xt, yt) = keras.datasets.cifar10.load_data()
        except Exception as e:
            raise MissingDataError(
                f"CIFAR-10 not found at {tried!r} and downloading it failed ({e}). "
                "Extract https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz "
                "and pass --config.data_dir=/path/to/cifar-10-batches-py."
            ) from e
    return (
        (np.asarray(x, "uint8"), np.asarray(y, "int64").reshape(-1)),
        (np.asarray(xt, "uint8"), np.asarray(yt, "int64").reshape(-1)),
    )


def random_crop_flip(image, crop_size):
    """Training augmentation: a random `crop_size` square crop and a random mirror.

    Args:
        image: one image `[H, W, C]` (a tensor), at least `crop_size` square.
        crop_size: side of the square crop.

    Returns:
        A `[crop_size, crop_size, C]` tensor, mirrored left-right with
        probability 1/2.

    Raises:
        tf.errors.InvalidArgumentError: the image is smaller than `crop_size`.
    """
    import tensorflow as tf

    channels = image.shape[-1]
    image = tf.image.random_crop(image, [crop_size, crop_size, channels])
    return tf.image.random_flip_left_right(image)


def center_crop(images, crop_size):
    """The centre `crop_size` square of a batch `[B, H, W, C]` (or one image).

    Args:
        images: a batch `[B, H, W, C]` or one image `[H, W, C]` (a tensor or an
            array), at least `crop_size` square.
        crop_size: side of the square crop.

    Returns:
        The same kind of tensor or array, of shape `[..., crop_size, crop_size, C]`.
    """
    h, w = images.shape[-3], images.shape[-2]
    top, left = (h - crop_size) // 2, (w - crop_size) // 2
    return images[..., top : top + crop_size, left : left + crop_size, :]


def ten_crops(images, crop_size):
    """Paine et al.'s / Krizhevsky's multi-crop test views of a batch `[B, H, W, C]`.

    Args:
        images: a batch `[B, H, W, C]`, at least `crop_size` square.
        crop_size: side of each square crop.

    Returns:
        A tensor `[10, B, crop_size, crop_size, C]`: the 4 corner crops, the
        centre crop, and the horizontal mirrors of those 5.
    """
    import tensorflow as tf

    h, w = images.shape[1], images.shape[2]
    c = crop_size
    crops = [
        images[:, :c, :c],
        images[:, :c, w - c :],
        images[:, h - c :, :c],
        images[:, h - c :, w - c :],
        center_crop(images, c),
    ]
    crops += [tf.reverse(x, axis=[2]) for x in crops]
    return tf.stack(crops)


def _imagenet_tfrecord_files(data_dir, split):
    import tensorflow as tf

    prefix = "train" if split == "train" else "validation"
    return sorted(tf.io.gfile.glob(os.path.join(data_dir, f"{prefix}-*")))


def _parse_imagenet_example(serialized, image_size):
    import tensorflow as tf

    features = tf.io.parse_single_example(
        serialized,
        {
            "image/encoded": tf.io.FixedLenFeature([], tf.string),
            "image/class/label": tf.io.FixedLenFeature([], tf.int64),
        },
    )
    image = tf.io.decode_jpeg(features["image/encoded"], channels=3)
    image = tf.image.resize(image, [image_size, image_size])
    return image, features["image/class/label"] - 1  # labels are stored 1..1000


def imagenet_dataset(data_dir, split, image_size=256, seed=0):
    """ImageNet as an unbatched `tf.data.Dataset` of (float image 0..255, int64 label).

    Reads `data_dir/{train,val}/<class>/*` with
    `keras.utils.image_dataset_from_directory`, or else TFRecords
    `data_dir/{train,validation}-*` (TF's ImageNet build-script layout, labels
    stored 1..1000). Never downloads.

    Args:
        data_dir: the directory holding `train/` and `val/`, or the TFRecords.
        split: "train" (shuffled, by file for TFRecords) or anything else for
            the validation split (in order).
        image_size: side of the square images are resized to.
        seed: the training split's shuffle seed.

    Returns:
        `(dataset, count)`: the dataset and its number of examples (-1 for
        TFRecords, where it is not known).

    Raises:
        MissingDataError: neither layout is under `data_dir`; the message names
            both paths tried and how to get the data.
    """
    import tensorflow as tf

    folder = os.path.join(data_dir, "train" if split == "train" else "val")
    if os.path.isdir(folder):
        import keras

        ds = keras.utils.image_dataset_from_directory(
            folder,
            labels="inferred",
            label_mode="int",
            image_size=(image_size, image_size),
            batch_size=None,
            shuffle=split == "train",
            seed=seed,
        )
        count = int(ds.cardinality())
        return ds.map(lambda x, y: (x, tf.cast(y, tf.int64))), count
    files = _imagenet_tfrecord_files(data_dir, split)
    if files:
        ds = tf.data.Dataset.from_tensor_slices(files)
        if split == "train":
            ds = ds.shuffle(len(files), seed=seed)
        ds = ds.interleave(tf.data.TFRecordDataset, num_parallel_calls=tf.data.AUTOTUNE)
        ds = ds.map(
            lambda s: _parse_imagenet_example(s, image_size),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
        return ds, -1
    raise MissingDataError(
        f"ImageNet {split} data not found under {data_dir!r}: tried the directory "
        f"{folder!r} (one sub-directory per class) and TFRecords "
        f"{os.path.join(data_dir, ('train' if split == 'train' else 'validation') + '-*')!r}. "
        "Download ILSVRC2012 from https://image-net.org (registration needed), "
        "arrange it as train/<wnid>/*.JPEG and val/<wnid>/*.JPEG (or build "
        "TFRecords), and pass --config.data_dir=/path/to/imagenet."
    )
