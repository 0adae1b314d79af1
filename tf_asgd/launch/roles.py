"""The launcher's task roles: chief, worker, ps, evaluator, or all of them locally.

`python -m tf_asgd.launch` is a thin absl front end over these functions. `run` dispatches
on `TF_CONFIG`: none, `run_local` (a loopback cluster, stopped at the end); `chief`,
`train_and_evaluate`; `worker` / `ps`, `serve_task`; `evaluator`, `evaluate_checkpoints`.
Roles and the workdir layout: docs/architecture.md and docs/launcher.md.

Example:
    from tf_asgd.launch import roles

    config = ...  # configs/default.py's get_config(), overridden as needed
    results = roles.run(config, workdir="/tmp/asgd")  # TF_CONFIG decides the role
"""

import contextlib
import json
import os
import signal
import threading
import time
import traceback

import keras
import tensorflow as tf
from absl import logging

from tf_asgd.cluster import local_cluster, task_server
from tf_asgd.cluster.local_cluster import LocalCluster
from tf_asgd.cluster.lost_tasks import lost_ps, task_lost_error
from tf_asgd.cluster.tf_config import make_resolver, tf_config_role
from tf_asgd.errors import ClusterTaskLostError
from tf_asgd.launch.config_fields import CHECKPOINT_DIR, used_workdir_message
from tf_asgd.launch.input_pipeline import load_data_arrays, make_data, ten_crop_evaluate
from tf_asgd.launch.run_parts import (
    DONE_FILE,
    InterruptCallback,
    StopSignals,
    checkpoint_on_interrupt,
    compile_model,
    fit_verbosity,
    make_checkpoint,
    make_checkpoint_callback,
    make_model,
    make_outer_optimizer,
    make_progress_callback,
    tensorboard_available,
)
from tf_asgd.strategy import AsyncParameterServerStrategy

# ---------------------------------------------------------------------------
# Roles and devices


def hide_gpus():
    """Keeps this process off the GPUs (PS tasks, the chief, the evaluator).

    Call before TensorFlow touches a device; both the environment variable
    (read by CUDA at initialisation) and TF's visible-device list are set.
    """
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:  # devices already initialised: the env var did the job or not
        logging.warning("GPUs were already initialised; could not hide them.")


# ---------------------------------------------------------------------------
# The chief


def train_and_evaluate(config, workdir, resolver, resume=False, stop=None):
    """Trains `config` on the cluster of `resolver` as its chief; returns the results dict.

    Writes checkpoints (each epoch), `metrics.csv`, TensorBoard logs,
    `model.keras`, `results.json` and `DONE` to `workdir`. With `resume`, the
    newest checkpoint restores the central variables, optimizer step, push
    counters (version) and the epoch count, and training continues from it;
    without, a workdir that already holds checkpoints is refused. A Ctrl-C or
    SIGTERM (a KeyboardInterrupt; `stop`, a `StopSignals`, raises it again
    after a batch if Python lost it) saves a checkpoint and re-raises.
    """
    t_start = time.time()
    latest = prepare_workdir(workdir, resume)
    keras.utils.set_random_seed(config.seed)
    arrays = load_data_arrays(config)  # fails fast on missing data, before connecting
    strategy = make_strategy(config, resolver)
    with strategy.scope():
        model = make_model(config)
        compile_model(model, config)
        model.optimizer.build(model.trainable_variables)
    data = make_data(config, arrays)  # after connecting: datasets live on the chief's new device
    epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
    checkpoint = make_checkpoint(model, strategy, epoch_var)
    ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)
    manager = tf.train.CheckpointManager(checkpoint, ckpt_dir, max_to_keep=config.max_checkpoints)
    initial_epoch = 0
    if resume:
        initial_epoch = resume_from(checkpoint, latest, ckpt_dir, epoch_var, strategy)

    def step_fn():
        return int(model.optimizer.iterations.numpy())

    callbacks = chief_callbacks(config, workdir, stop, manager, epoch_var, step_fn, initial_epoch)
    cluster = resolver.cluster_spec().as_dict()
    with checkpoint_on_stop(manager, step_fn, stop, cluster, epoch_var):
        history = model.fit(
            data.train,
            epochs=config.epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=data.steps_per_epoch,
            validation_data=data.test if config.validate_every_epoch else None,
            validation_steps=data.test_steps,
            callbacks=callbacks,
            verbose=fit_verbosity(config),
        )
        if stop is not None:
            stop.check()
        test = model.evaluate(data.test, steps=data.test_steps, return_dict=True, verbose=0)
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
        noise_scale=stats.noise_scale,
        lr_scale=stats.lr_scale,
        lr_scale_peak=stats.lr_scale_peak,
        num_workers=len(resolver.cluster_spec().as_dict().get("worker", [])),
        wall_seconds=time.time() - t_start,
        history={k: [float(x) for x in v] for k, v in history.history.items()},
    )
    write_outputs(workdir, model, results)
    logging.info(
        "done: test accuracy %.4f, loss %.4f, %d windows, mean staleness %.2f, %.1f s; "
        "checkpoint %s",
        results.get("test_accuracy", float("nan")),
        results.get("test_loss", float("nan")),
        stats.windows,
        stats.mean_staleness,
        results["wall_seconds"],
        manager.latest_checkpoint,
    )
    log_workers_rate(stats, config.lr_scaling)
    log_noise_scale(stats)
    return results


def log_workers_rate(stats, lr_scaling):
    """Logs the factor on the workers' rate, where it is not 1."""
    if stats.lr_scale_peak != stats.lr_scale:
        logging.info(
            "the workers ran at up to %.3g times the optimizer's rate, falling as 1/t toward "
            "%.3g (%.3g at the end; lr_scaling=%r, warmed up over %d steps; docs/defaults.md)",
            stats.lr_scale_peak,
            stats.lr_scale,
            stats.lr_scale_end,
            lr_scaling,
            stats.lr_warmup_steps,
        )
    elif stats.lr_scale != 1.0:
        logging.info(
            "the workers ran at %.3g times the optimizer's rate (lr_scaling=%r, warmed up over "
            "%d steps; docs/defaults.md)",
            stats.lr_scale,
            lr_scaling,
            stats.lr_warmup_steps,
        )


def log_noise_scale(stats):
    """Logs the last epoch's gradient noise scale and the workers that pay, where measured."""
    if not stats.noise_scale_rounds:
        return
    pay = stats.workers_that_pay
    logging.info(
        "gradient noise scale %.3g windows over the last epoch's %d round(s): %s",
        stats.noise_scale,
        stats.noise_scale_rounds,
        f"about {pay} worker(s) pay about linearly; more pay less (docs/defaults.md)"
        if pay
        else "the windows did not agree enough to measure it",
    )


def prepare_workdir(workdir, resume):
    """Makes `workdir` and removes its `DONE`; returns its newest checkpoint (None: none).

    Raises:
        ValueError: `workdir` holds checkpoints and `resume` is False.
    """
    os.makedirs(workdir, exist_ok=True)
    latest = newest_checkpoint_unless_refused(workdir, resume)
    if os.path.exists(os.path.join(workdir, DONE_FILE)):
        os.remove(os.path.join(workdir, DONE_FILE))
    return latest


def make_strategy(config, resolver):
    """The chief's `AsyncParameterServerStrategy` on `resolver`'s cluster, as `config` says."""
    return AsyncParameterServerStrategy(
        resolver,
        n_sync=config.n_sync,
        synchronous=config.synchronous,
        staleness=config.staleness,
        max_staleness=config.max_staleness,
        outer_optimizer=make_outer_optimizer(config),
        worker_state=config.worker_state,
        windows_per_closure=config.windows_per_closure or None,
        compression=config.compression,
        pull_compression=config.pull_compression,
        snapshot_every=config.snapshot_every or None,
        lr_scaling=_lr_scaling(config.lr_scaling),
        connect_timeout=config.connect_timeout,
    )


def _lr_scaling(text):
    """The config's `lr_scaling`: a rule's name, or a factor written as a number."""
    try:
        return float(text)
    except ValueError:
        return text


def resume_from(checkpoint, latest, ckpt_dir, epoch_var, strategy):
    """Restores `checkpoint` from `latest` (None: starts from scratch) and returns the
    epochs it had done."""
    if not latest:
        logging.info("--resume: no checkpoint in %s, starting from scratch", ckpt_dir)
        return 0
    checkpoint.restore(latest).assert_existing_objects_matched()
    initial_epoch = int(epoch_var.numpy())
    logging.info(
        "resumed from %s: epoch %d, version %d",
        latest,
        initial_epoch,
        int(strategy.counters.version.numpy()),
    )
    return initial_epoch


def chief_callbacks(config, workdir, stop, manager, epoch_var, step_fn, initial_epoch):
    """The chief's `fit` callbacks: interrupts (`stop`, a `StopSignals`, or None),
    progress, a checkpoint per epoch, `metrics.csv` (appended to after `initial_epoch`
    0) and TensorBoard logs where TensorBoard is installed."""
    callbacks = [
        *([InterruptCallback(stop)] if stop is not None else []),
        make_progress_callback(config, config.batch_size),
        make_checkpoint_callback(manager, epoch_var, step_fn),
        keras.callbacks.CSVLogger(os.path.join(workdir, "metrics.csv"), append=initial_epoch > 0),
    ]
    if tensorboard_available():
        callbacks.append(
            keras.callbacks.TensorBoard(
                os.path.join(workdir, "tensorboard"),
                write_graph=False,
                update_freq="epoch",
                profile_batch=0,
            )
        )
    else:
        logging.warning(
            "TensorBoard is not installed (pip install tensorboard): no TensorBoard logs."
        )
    return callbacks


@contextlib.contextmanager
def checkpoint_on_stop(manager, step_fn, stop, cluster, epoch_var):
    """Around the chief's `fit` and `evaluate`: Ctrl-C or SIGTERM (a KeyboardInterrupt,
    or `stop` requested) saves a checkpoint and raises KeyboardInterrupt; a lost task
    (`tf.errors.UnavailableError`) raises `ClusterTaskLostError` naming it."""
    try:
        yield
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (see StopSignals)
        checkpoint_on_interrupt(manager, step_fn)
        raise
    except Exception as e:
        if stop is not None and stop.requested.is_set():
            # The signal's KeyboardInterrupt, raised inside TF's C++ bindings,
            # can come out as another error (pybind11: "ORIGINAL
            # InvalidArgumentError REPLACED BY KeyboardInterrupt").
            checkpoint_on_interrupt(manager, step_fn)
            raise KeyboardInterrupt(f"signal {stop.signum}") from e
        if isinstance(e, ClusterTaskLostError):  # a PS lost in `fit`: name the checkpoint too
            e = e.__cause__ or e
        if isinstance(e, tf.errors.OpError) and (
            isinstance(e, tf.errors.UnavailableError)  # the coordinator's PSUnavailableError too
            or lost_ps(e, cluster)
        ):
            raise task_lost_error(e, cluster, manager, epoch_var) from e
        raise


def write_outputs(workdir, model, results):
    """Writes `model.keras`, `results.json` and, last, `DONE` (the epochs done) to `workdir`."""
    model.save(os.path.join(workdir, "model.keras"))
    with open(os.path.join(workdir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(workdir, DONE_FILE), "w") as f:
        f.write(str(results["epochs"]))


def newest_checkpoint_unless_refused(workdir, resume):
    """The newest checkpoint in `workdir` (None: none).

    Raises:
        ValueError: `workdir` holds checkpoints and `resume` is False.
    """
    latest = tf.train.latest_checkpoint(os.path.join(workdir, CHECKPOINT_DIR))
    if latest and not resume:
        raise ValueError(used_workdir_message(workdir, latest))
    return latest


def run_local(config, workdir, resume=False, stop=None):
    """No `TF_CONFIG`: trains on a `LocalCluster` of loopback tasks, then stops them all.

    The cluster's processes are stopped on success, on an exception, on
    Ctrl-C and on SIGTERM (and, through their stdin lifeline, if this process
    dies). Shutdown order: the run's objects (model, strategy, datasets) are
    released and collected while the tasks still answer (each tf.function
    freed on the chief is removed from every task by a synchronous RPC), then
    the tasks are stopped.
    """
    newest_checkpoint_unless_refused(workdir, resume)  # before any task starts
    hide_gpus()  # the chief keeps off the GPUs; local workers get theirs below
    shared = config.shared_process and not config.gpus_per_worker
    if config.shared_process and config.gpus_per_worker:
        logging.info("gpus_per_worker=%d: one process per task", config.gpus_per_worker)
    logging.info(
        "starting a local cluster: %d worker(s), %d ps%s",
        config.num_workers,
        config.num_ps,
        f", {config.gpus_per_worker} GPU(s) per worker" if config.gpus_per_worker else "",
    )
    with LocalCluster(
        config.num_workers,
        config.num_ps,
        shared_process=shared,
        gpus_per_worker=config.gpus_per_worker,
    ) as local:  # its close() collects garbage first, then stops the tasks
        logging.info(
            "local cluster %s, processes %s, forked from %s",
            json.dumps(local.cluster_spec),
            local.pids(),
            local.fork_server_pid,
        )
        restarts = None
        if config.snapshot_every:  # a lost PS is recovered once it is back
            restarts = local_cluster.RestartLostTasks(local, "ps").start()
        try:
            return train_and_evaluate(config, workdir, local.resolver, resume=resume, stop=stop)
        except BaseException as e:
            release_frames(e)
            raise
        finally:
            if restarts is not None:
                restarts.stop()


def release_frames(error):
    """Drops the local variables of the finished frames in `error`'s
    traceback (and its causes'), so that what they held (a model, a strategy,
    datasets) can be collected now, while the cluster still answers, rather
    than when the exception is gone. Tracebacks still print."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


# ---------------------------------------------------------------------------
# Workers, parameter servers, the evaluator, and dispatch


def serve_task(cluster, task_type, task_index, stop_event=None):
    """Starts this process's TF server (`worker` or `ps`) and serves until stopped.

    Stops on SIGTERM or SIGINT (how Kubernetes and Ctrl-C end it), or when
    `stop_event` (a `threading.Event`) is set.
    """
    if task_type == "ps":
        hide_gpus()
    stop = stop_event or threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        servers = task_server.serve(cluster, [f"{task_type}:{task_index}"], announce=False)
        logging.info(
            "%s:%d serving at %s until SIGTERM",
            task_type,
            task_index,
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
    hide_gpus()
    data = make_data(config)
    model = make_model(config)
    compile_model(model, config)
    epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
    checkpoint = tf.train.Checkpoint(model=model, epoch=epoch_var)
    writer = (
        tf.summary.create_file_writer(os.path.join(workdir, "tensorboard", "eval_checkpoints"))
        if tensorboard_available()
        else None
    )
    ckpt_dir = os.path.join(workdir, CHECKPOINT_DIR)

    def done():
        return os.path.exists(os.path.join(workdir, DONE_FILE))

    out = []
    for path in _new_checkpoints(ckpt_dir, done, timeout_secs):
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


EVALUATOR_POLL_S = 1.0  # between looks for a new checkpoint
EVALUATOR_SAY_S = 60.0  # between log lines while none comes


def _new_checkpoints(ckpt_dir, done, timeout_secs=None):
    """Each new latest checkpoint in `ckpt_dir` as it appears, until `done()` holds and
    the latest has been yielded (the chief's last one is always evaluated), or none came
    for `timeout_secs`. Says where it waits, and again every `EVALUATOR_SAY_S` while
    nothing comes (a mistyped workdir would wait in silence). (TF's `checkpoints_iterator`
    asks its `timeout_fn` after every checkpoint too, so it ended before the last.)"""
    logging.info("evaluator: waiting for checkpoints in %s", ckpt_dir)
    last, since, said = None, time.monotonic(), time.monotonic()
    while True:
        finished = done()  # read first: a checkpoint written before DONE is seen below
        latest = tf.train.latest_checkpoint(ckpt_dir)
        if latest is not None and latest != last:
            last, since = latest, time.monotonic()
            yield latest
            continue
        if finished:
            return
        now = time.monotonic()
        if timeout_secs and now - since > timeout_secs:
            logging.info("evaluator: no new checkpoint in %s for %g s", ckpt_dir, timeout_secs)
            return
        if now - said > EVALUATOR_SAY_S:
            logging.info("evaluator: still waiting for a checkpoint in %s", ckpt_dir)
            said = now
        time.sleep(EVALUATOR_POLL_S)


def run_task(config, workdir, cluster, task_type, task_index, resume=False, stop=None):
    """Runs this process's role in a `TF_CONFIG` cluster. The chief stops on
    Ctrl-C / SIGTERM (`stop`, a `StopSignals`) after a checkpoint."""
    if task_type == "chief":
        hide_gpus()
        resolver = make_resolver(cluster, "chief", task_index)
        stop = stop or StopSignals()
        with stop:
            return train_and_evaluate(config, workdir, resolver, resume=resume, stop=stop)
    if task_type in ("worker", "ps"):
        serve_task(cluster, task_type, task_index)
        return None
    if task_type == "evaluator":
        return evaluate_checkpoints(config, workdir)
    raise ValueError(f"Unknown task type {task_type!r}.")


def run(config, workdir, resume=False, environ=None, stop=None):
    """The launcher's entry point: the role from `TF_CONFIG`, or a local cluster.

    `stop` (a `StopSignals`, default one with a 60 s bound) turns Ctrl-C and
    SIGTERM into a KeyboardInterrupt for a local run and the chief: a
    checkpoint, every local task stopped, then the KeyboardInterrupt.
    """
    role = tf_config_role(environ)
    if role is None:
        stop = stop or StopSignals()
        with stop:
            return run_local(config, workdir, resume=resume, stop=stop)
    cluster, task_type, task_index = role
    logging.info("TF_CONFIG: %s:%d of %s", task_type, task_index, json.dumps(cluster))
    return run_task(config, workdir, cluster, task_type, task_index, resume=resume, stop=stop)
