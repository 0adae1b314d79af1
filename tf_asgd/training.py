"""The launcher's library: build a run from a config, train, evaluate, serve.

`python -m tf_asgd.launch` is a thin absl front end over these functions;
they can be called from Python too:

```python
from tf_asgd import training
import ml_collections.config_flags  # or build the ConfigDict yourself

config = ...  # configs/default.py's get_config(), overridden as needed
results = training.run(config, workdir="/tmp/asgd")  # TF_CONFIG decides the role
```

Roles (`run` dispatches on `TF_CONFIG`, see `tf_asgd.cluster.parse_tf_config`):
- no `TF_CONFIG`: `run_local` starts a `LocalCluster` (loopback), trains on
  it as the chief, evaluates, writes the workdir, and stops every process;
- `chief`: `train_and_evaluate` against the cluster of `TF_CONFIG`;
- `worker` / `ps`: `serve_task` starts the TF server and serves until SIGTERM;
- `evaluator`: `evaluate_checkpoints` evaluates each new checkpoint.

Workdir layout: `checkpoints/` (central variables, optimizer step, push
counters and the epoch, by `tf.train.CheckpointManager`), `model.keras`
(`model.save` at the end), `tensorboard/`, `metrics.csv` (one row per
epoch), `results.json` (final metrics and push statistics), `DONE`.
"""

import json
import os
import signal
import threading
import time

from absl import logging

from tf_asgd import cluster as cluster_lib

DATASETS = ("digits", "mnist", "cifar10", "imagenet")
MODELS = (
    "digits_convnet",
    "gem_mnist_convnet",
    "cuda_convnet_cifar10",
    "paine2013_imagenet_convnet",
)
CHECKPOINT_DIR = "checkpoints"
DONE_FILE = "DONE"


class ClusterTaskLostError(RuntimeError):
    """Training stopped because a cluster task (a parameter server, or every
    worker) could not be reached. The message names the unreachable tasks and
    the checkpoint to `--resume` from."""


# ---------------------------------------------------------------------------
# Roles and devices


def tf_config_role(environ=None):
    """`(cluster, task_type, task_index)` from `TF_CONFIG`, or `None` when unset.

    Raises `ValueError` quoting what is wrong with a malformed `TF_CONFIG`
    (bad JSON, unknown role, index out of range, no ps or worker, no chief).
    """
    environ = os.environ if environ is None else environ
    text = environ.get("TF_CONFIG", "")
    if not text.strip():
        return None
    cluster, task_type, task_index = cluster_lib.parse_tf_config(text)
    chiefs = cluster.get("chief", [])
    if len(chiefs) != 1:
        raise ValueError(
            "TF_CONFIG cluster needs exactly one 'chief' task (it runs the "
            f"coordinator and the training loop), got {chiefs!r} in: {text!r}"
        )
    return cluster, task_type, task_index


def hide_gpus():
    """Keeps this process off the GPUs (PS tasks, the chief, the evaluator).

    Call before TensorFlow touches a device; both the environment variable
    (read by CUDA at initialisation) and TF's visible-device list are set.
    """
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import tensorflow as tf

    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # devices already initialised: the env var did the job or not
        logging.warning("GPUs were already initialised; could not hide them.")


# ---------------------------------------------------------------------------
# Builders


def make_model(config):
    """The Keras model named by `config.model` (a builder in `tf_asgd.models`)."""
    from tf_asgd import models

    if config.model not in MODELS:
        raise ValueError(f"Unknown model {config.model!r}; expected one of {MODELS}.")
    builder = getattr(models, config.model)
    if config.model == "cuda_convnet_cifar10":
        crop = config.crop_size or 24
        return builder(input_shape=(crop, crop, 3))
    if config.model == "paine2013_imagenet_convnet":
        crop = config.crop_size or 224
        return builder(input_shape=(crop, crop, 3))
    if config.model == "gem_mnist_convnet" and config.dataset == "digits":
        return builder(input_shape=(8, 8, 1))
    return builder()


def make_optimizer(config):
    """`config.optimizer` as a Keras optimizer, wrapped in GEM when `config.gem.enabled`."""
    import keras

    o = config.optimizer
    if o.name == "sgd":
        opt = keras.optimizers.SGD(o.learning_rate, momentum=o.momentum)
    elif o.name == "adam":
        opt = keras.optimizers.Adam(o.learning_rate)
    else:
        raise ValueError(f"Unknown optimizer {o.name!r}; expected 'sgd' or 'adam'.")
    if config.gem.enabled:
        from tf_asgd import optimizers

        opt = optimizers.GEM(opt, kappa=config.gem.kappa)
    return opt


def compile_model(model, config):
    import keras

    model.compile(
        make_optimizer(config),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


class Data:
    """Datasets of a run: `train` (batched, finite), `test` (batched), sizes."""

    def __init__(self, train, test, steps_per_epoch, test_steps=None, test_images=None):
        self.train, self.test = train, test
        self.steps_per_epoch, self.test_steps = steps_per_epoch, test_steps
        self.test_images = test_images  # uncropped test batches for 10-crop eval


def load_data_arrays(config):
    """Loads `config.dataset` from disk (NumPy arrays; for imagenet checks the files).

    Raises `tf_asgd.data.MissingDataError` with the path tried when absent.
    Call before connecting to a cluster: tf.data datasets must be created
    after (`make_data`), since connecting changes the chief's device names.
    """
    from tf_asgd import data

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
    import tensorflow as tf

    from tf_asgd import data

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
        n_train = 1_281_167  # ILSVRC 2012 training images (TFRecords: count unknown)
    test = val.map(lambda i, lab: (data.center_crop(i, crop), lab), tf.data.AUTOTUNE)
    return finish(train, n_train, test, test_images=val if config.ten_crop_eval else None)


def ten_crop_evaluate(model, images, crop_size, steps=None):
    """Multi-crop test accuracy: softmax averaged over `data.ten_crops` views.

    `images` yields batches `(x [B, H, W, C], y [B])` of uncropped images.
    Returns `{"ten_crop_accuracy": top-1, "ten_crop_top5_accuracy": top-5}`.
    """
    import numpy as np
    import tensorflow as tf

    from tf_asgd import data

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


# ---------------------------------------------------------------------------
# Callbacks


def _keras_callback_base():
    import keras

    return keras.callbacks.Callback


def make_progress_callback(config, batch_size):
    """Adds `samples_per_sec` to the epoch logs; logs a progress line every `log_every_secs`."""

    class Progress(_keras_callback_base()):
        def on_epoch_begin(self, epoch, logs=None):
            self._epoch = epoch
            self._t0 = self._last = time.time()

        def on_train_batch_end(self, batch, logs=None):
            every = config.log_every_secs
            now = time.time()
            if not every or now - self._last < every:
                return
            self._last = now
            logs = logs or {}
            steps = batch + 1
            logging.info(
                "epoch %d/%d step %d/%s: %.0f samples/s, loss %.4f, staleness %.2f, windows %d",
                self._epoch + 1, self.params.get("epochs"), steps, self.params.get("steps"),
                steps * batch_size / max(now - self._t0, 1e-9),
                logs.get("loss", float("nan")), logs.get("staleness", 0.0),
                int(logs.get("windows", 0)),
            )

        def on_epoch_end(self, epoch, logs=None):
            if logs is not None:
                steps = self.params.get("steps") or 0
                logs["samples_per_sec"] = steps * batch_size / max(time.time() - self._t0, 1e-9)
                logging.info(
                    "epoch %d/%d done: %s", epoch + 1, self.params.get("epochs"),
                    ", ".join(f"{k} {v:.4g}" for k, v in sorted(logs.items())),
                )

    return Progress()


def save_checkpoint(manager, step, reason):
    """Saves `checkpoints/ckpt-STEP` (STEP: the optimizer's global step) unless
    the newest checkpoint already has that step. Returns the path or None.

    `tf.train.CheckpointManager` writes the files under temporary names and
    renames them, then rewrites the `checkpoint` state file atomically, so
    `tf.train.latest_checkpoint` (what `--resume` reads) only ever names a
    complete checkpoint.
    """
    latest = manager.latest_checkpoint
    if latest and latest.endswith(f"-{step}"):
        return None
    path = manager.save(checkpoint_number=step)
    logging.info("saved checkpoint %s (%s)", path, reason)
    return path


def make_checkpoint_callback(manager, epoch_var, step_fn):
    """Saves a checkpoint after every epoch, with the epochs done inside."""

    class Checkpoint(_keras_callback_base()):
        def on_epoch_end(self, epoch, logs=None):
            epoch_var.assign(epoch + 1)
            save_checkpoint(manager, step_fn(), f"epoch {epoch + 1}")

    return Checkpoint()


def unreachable_tasks(cluster, timeout=2.0):
    """`["ps:0 (localhost:1234)", ...]`: tasks of `cluster` (a dict) whose port
    refuses a TCP connection (the chief's own entry is skipped)."""
    import socket

    down = []
    for job, addresses in sorted(cluster.items()):
        if job in ("chief", "evaluator"):
            continue
        for i, address in enumerate(addresses):
            host, port = address.rsplit(":", 1)
            try:
                socket.create_connection((host, int(port)), timeout=timeout).close()
            except OSError:
                down.append(f"{job}:{i} ({address})")
    return down


def _task_lost(error, cluster, manager, epoch_var):
    down = unreachable_tasks(cluster)
    latest = manager.latest_checkpoint
    where = (
        f"The newest checkpoint is {latest} (epoch {int(epoch_var.numpy())}); rerun "
        "with --resume to continue from it."
        if latest else "No checkpoint was written yet; rerun to start again."
    )
    what = (
        f"unreachable: {', '.join(down)}" if down
        else "every task still accepts connections, so the link failed"
    )
    return ClusterTaskLostError(
        f"Training stopped: lost contact with the cluster ({what}). The parameter "
        "servers hold the central variables, so training cannot go on without "
        f"one. {where} (TensorFlow said: {str(error).splitlines()[0][:300]})"
    )


# ---------------------------------------------------------------------------
# Roles


def _checkpoint(model, strategy, epoch_var):
    import tensorflow as tf

    parts = {"model": model, "epoch": epoch_var}
    if model.optimizer is not None and model.optimizer.built:
        parts["optimizer"] = model.optimizer
    if strategy is not None:
        parts["counters"] = strategy.counters
    return tf.train.Checkpoint(**parts)


def tensorboard_available():
    """Whether `tf.summary` can write (the `tensorboard` package is installed)."""
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def _verbose(config):
    import sys

    if config.verbose >= 0:
        return config.verbose
    return 1 if sys.stdout.isatty() else 2


def train_and_evaluate(config, workdir, resolver, resume=False):
    """Trains `config` on the cluster of `resolver` as its chief; returns the results dict.

    Writes checkpoints (each epoch), `metrics.csv`, TensorBoard logs,
    `model.keras`, `results.json` and `DONE` to `workdir`. With `resume`, the
    newest checkpoint restores the central variables, optimizer step, push
    counters (version) and the epoch count, and training continues from it;
    without, a workdir that already holds checkpoints is refused.
    """
    import keras
    import tensorflow as tf

    from tf_asgd.strategy import AsyncParameterServerStrategy

    t_start = time.time()
    os.makedirs(workdir, exist_ok=True)
    ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
    latest = tf.train.latest_checkpoint(ckpt_dir)
    if latest and not resume:
        raise ValueError(
            f"{workdir!r} already holds checkpoints ({latest}); pass --resume to "
            "continue from the newest one, or use a fresh --workdir."
        )
    if os.path.exists(os.path.join(workdir, DONE_FILE)):
        os.remove(os.path.join(workdir, DONE_FILE))
    keras.utils.set_random_seed(config.seed)
    arrays = load_data_arrays(config)  # fails fast on missing data, before connecting

    strategy = AsyncParameterServerStrategy(
        resolver,
        n_sync=config.n_sync,
        staleness=config.staleness,
        max_staleness=config.max_staleness,
    )
    with strategy.scope():
        model = make_model(config)
        compile_model(model, config)
        model.optimizer.build(model.trainable_variables)
    data = make_data(config, arrays)  # after connecting: datasets live on the chief's new device
    epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
    checkpoint = _checkpoint(model, strategy, epoch_var)
    manager = tf.train.CheckpointManager(checkpoint, ckpt_dir, max_to_keep=config.max_checkpoints)
    initial_epoch = 0
    if resume and latest:
        checkpoint.restore(latest).assert_existing_objects_matched()
        initial_epoch = int(epoch_var.numpy())
        logging.info(
            "resumed from %s: epoch %d, version %d", latest, initial_epoch,
            int(strategy.counters.version.numpy()),
        )
    elif resume:
        logging.info("--resume: no checkpoint in %s, starting from scratch", ckpt_dir)

    def step_fn():
        return int(model.optimizer.iterations.numpy())

    callbacks = [
        make_progress_callback(config, config.batch_size),
        make_checkpoint_callback(manager, epoch_var, step_fn),
        keras.callbacks.CSVLogger(os.path.join(workdir, "metrics.csv"), append=initial_epoch > 0),
    ]
    if tensorboard_available():
        callbacks.append(
            keras.callbacks.TensorBoard(
                os.path.join(workdir, "tensorboard"), write_graph=False, update_freq="epoch",
                profile_batch=0,
            )
        )
    else:
        logging.warning("TensorBoard is not installed (pip install tensorboard): no TensorBoard logs.")
    cluster = resolver.cluster_spec().as_dict()
    try:
        history = model.fit(
            data.train,
            epochs=config.epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=data.steps_per_epoch,
            validation_data=data.test if config.validate_every_epoch else None,
            validation_steps=data.test_steps,
            callbacks=callbacks,
            verbose=_verbose(config),
        )
        test = model.evaluate(data.test, steps=data.test_steps, return_dict=True, verbose=0)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (see _sigterm_as_keyboard_interrupt)
        _checkpoint_on_interrupt(manager, step_fn)
        raise
    except tf.errors.UnavailableError as e:  # includes the coordinator's PSUnavailableError
        raise _task_lost(e, cluster, manager, epoch_var) from e
    results = {f"test_{k}": float(v) for k, v in test.items()}
    if data.test_images is not None:
        results.update(
            ten_crop_evaluate(model, data.test_images, config.crop_size or 224, data.test_steps)
        )
    stats = strategy.model_stats(model)
    results.update(
        epochs=int(epoch_var.numpy()),
        initial_epoch=initial_epoch,
        version=int(strategy.counters.version.numpy()),
        windows=stats.windows,
        applied=stats.applied,
        mean_staleness=stats.mean_staleness,
        max_staleness=stats.max_staleness,
        dropped_stale=stats.dropped_stale,
        dropped_nonfinite=stats.dropped_nonfinite,
        num_workers=len(resolver.cluster_spec().as_dict().get("worker", [])),
        wall_seconds=time.time() - t_start,
        history={k: [float(x) for x in v] for k, v in history.history.items()},
    )
    model.save(os.path.join(workdir, "model.keras"))
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(workdir, DONE_FILE), "w") as f:
        f.write(str(results["epochs"]))
    logging.info(
        "done: test accuracy %.4f, loss %.4f, %d windows, mean staleness %.2f, %.1f s",
        results.get("test_accuracy", float("nan")), results.get("test_loss", float("nan")),
        stats.windows, stats.mean_staleness, results["wall_seconds"],
    )
    return results


def _checkpoint_on_interrupt(manager, step_fn):
    """Saves a checkpoint of the central variables after Ctrl-C or SIGTERM.

    Windows already pushed are kept (the epoch count stays at the last epoch
    finished: `--resume` restarts that epoch with the trained weights).
    Further Ctrl-C/SIGTERM are ignored while it saves.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, signal.SIG_IGN)
    try:
        if save_checkpoint(manager, step_fn(), "interrupted") is None:
            logging.info("interrupted: the newest checkpoint %s already holds every pushed window",
                         manager.latest_checkpoint)
    except Exception as e:  # a dead PS: nothing to save; report and go on stopping
        logging.error("could not save a checkpoint on interrupt: %s", str(e).splitlines()[0])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _sigterm_as_keyboard_interrupt():
    """SIGTERM raises KeyboardInterrupt in the main thread, so `finally` blocks run."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, handler)


def run_local(config, workdir, resume=False):
    """No `TF_CONFIG`: trains on a `LocalCluster` of loopback tasks, then stops them all.

    The cluster's processes are stopped on success, on an exception, on
    Ctrl-C and on SIGTERM (and, through their stdin lifeline, if this process
    dies).
    """
    from tf_asgd.cluster import LocalCluster

    hide_gpus()  # the chief keeps off the GPUs; local workers get theirs below
    shared = config.shared_process and not config.gpus_per_worker
    if config.shared_process and config.gpus_per_worker:
        logging.info("gpus_per_worker=%d: one process per task", config.gpus_per_worker)
    previous = _sigterm_as_keyboard_interrupt()
    try:
        logging.info(
            "starting a local cluster: %d worker(s), %d ps%s", config.num_workers,
            config.num_ps, f", {config.gpus_per_worker} GPU(s) per worker"
            if config.gpus_per_worker else "",
        )
        with LocalCluster(
            config.num_workers, config.num_ps, shared_process=shared,
            gpus_per_worker=config.gpus_per_worker,
        ) as local:
            logging.info("local cluster %s, processes %s", json.dumps(local.cluster_spec), local.pids())
            return train_and_evaluate(config, workdir, local.resolver, resume=resume)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def serve_task(cluster, task_type, task_index, stop_event=None):
    """Starts this process's TF server (`worker` or `ps`) and serves until stopped.

    Stops on SIGTERM or SIGINT (how Kubernetes and Ctrl-C end it), or when
    `stop_event` (a `threading.Event`) is set.
    """
    from tf_asgd import task_server

    if task_type == "ps":
        hide_gpus()
    stop = stop_event or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        servers = task_server.serve(cluster, [f"{task_type}:{task_index}"])
        logging.info(
            "%s:%d serving at %s until SIGTERM", task_type, task_index,
            cluster[task_type][task_index],
        )
        while not stop.wait(1.0):
            pass
        logging.info("%s:%d stopping", task_type, task_index)
        del servers
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def evaluate_checkpoints(config, workdir, timeout_secs=None):
    """The `evaluator` role: evaluates each new checkpoint in `workdir` as it appears.

    Builds the model locally (no strategy), restores the central variables of
    each checkpoint, evaluates the test split and writes `eval_metrics.csv`
    and TensorBoard `tensorboard/eval_checkpoints`. Returns the list of
    results when the chief writes `DONE`, the last epoch is evaluated, or no
    checkpoint appears for `timeout_secs`.
    """
    import tensorflow as tf

    hide_gpus()
    data = make_data(config)
    model = make_model(config)
    compile_model(model, config)
    epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
    checkpoint = tf.train.Checkpoint(model=model, epoch=epoch_var)
    writer = (
        tf.summary.create_file_writer(os.path.join(workdir, "tensorboard", "eval_checkpoints"))
        if tensorboard_available() else None
    )
    ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
    done = lambda: os.path.exists(os.path.join(workdir, DONE_FILE))  # noqa: E731
    out = []
    # Poll every 5 s until DONE appears (or, with timeout_secs, until no new
    # checkpoint came for that long).
    checkpoints = tf.train.checkpoints_iterator(
        ckpt_dir, min_interval_secs=1, timeout=timeout_secs or 5,
        timeout_fn=lambda: done() or bool(timeout_secs),
    )
    for path in checkpoints:
        checkpoint.restore(path).expect_partial()
        epoch = int(epoch_var.numpy())
        result = model.evaluate(data.test, steps=data.test_steps, return_dict=True, verbose=0)
        result = {k: float(v) for k, v in result.items()}
        result["epoch"] = epoch
        out.append(result)
        logging.info("evaluated %s: %s", path, result)
        if writer is not None:
            with writer.as_default():
                for k, v in result.items():
                    if k != "epoch":
                        tf.summary.scalar(k, v, step=epoch)
        csv = os.path.join(workdir, "eval_metrics.csv")
        new = not os.path.exists(csv)
        with open(csv, "a") as f:
            if new:
                f.write(",".join(sorted(result)) + "\n")
            f.write(",".join(str(result[k]) for k in sorted(result)) + "\n")
        if epoch >= config.epochs:
            break
    return out


def run_task(config, workdir, cluster, task_type, task_index, resume=False):
    """Runs this process's role in a `TF_CONFIG` cluster."""
    if task_type == "chief":
        hide_gpus()
        resolver = cluster_lib.make_resolver(cluster, "chief", task_index)
        previous = _sigterm_as_keyboard_interrupt()  # SIGTERM: checkpoint, then stop
        try:
            return train_and_evaluate(config, workdir, resolver, resume=resume)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    if task_type in ("worker", "ps"):
        serve_task(cluster, task_type, task_index)
        return None
    if task_type == "evaluator":
        return evaluate_checkpoints(config, workdir)
    raise ValueError(f"Unknown task type {task_type!r}.")


def run(config, workdir, resume=False, environ=None):
    """The launcher's entry point: the role from `TF_CONFIG`, or a local cluster."""
    role = tf_config_role(environ)
    if role is None:
        return run_local(config, workdir, resume=resume)
    cluster, task_type, task_index = role
    logging.info("TF_CONFIG: %s:%d of %s", task_type, task_index, json.dumps(cluster))
    return run_task(config, workdir, cluster, task_type, task_index, resume=resume)
