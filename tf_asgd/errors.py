"""Every error tf_asgd raises of its own, in one place.

Each names what failed and what to do. This module imports nothing from the package (the
lowest layer), so any module may raise these; the modules that raise them also import them
under their own names (`tf_asgd.runtime.steps.TrainStepError` is `tf_asgd.TrainStepError`).

Example:
    try:
        strategy = tf_asgd.AsyncParameterServerStrategy(resolver, connect_timeout=30)
    except tf_asgd.errors.ClusterUnreachableError as e:
        print(e)  # names each unanswering task, its address and the reason
"""


def _named(tasks):
    """`"job:index at address (reason); ..."` for `(job, index, address, reason)` tuples."""
    return "; ".join(f"{job}:{i} at {address} ({reason})" for job, i, address, reason in tasks)


# ---- refused before any window is scheduled (`fit`) -------------------------


class UnsupportedFeatureError(ValueError):
    """A Keras feature that windows cannot honour exactly, refused before any window is scheduled.

    Raised by `fit` for an optimizer option that a window cannot honour as plain
    Keras would: GEM under `mixed_float16` or with `use_ema`,
    `gradient_accumulation_steps`, `loss_scale_factor` or `weight_decay`;
    gradient accumulation under a `LossScaleOptimizer`, with a model's own
    `train_step`, or with windows (`n_sync`, the epoch's steps) that are not
    whole accumulation cycles; `use_ema` with a model's own `train_step` or on
    variables that are not the model's. A
    `ValueError`; its message names the feature, why, and what to do instead.

    Example:

    ```python
    model.compile(keras.optimizers.SGD(0.1, gradient_accumulation_steps=4), loss)
    model.fit(x, y)  # n_sync=10: UnsupportedFeatureError ("make `n_sync` ... multiples of 4")
    ```
    """


class MetricStateError(ValueError):
    """A compiled or model metric whose state cannot be merged over windows.

    Raised by `fit`, before any window is scheduled, for a metric whose
    variables do not merge by addition: an `aggregation` other than "sum", or
    an update that is not `state + value` with a value that reads no metric
    state (e.g. a running maximum). A `ValueError`; its message
    names each such metric, its variable and why, and says how to compute it
    on the chief instead. (`evaluate` runs such a metric on the chief, with a
    log line, rather than raising.)

    Example:

    ```python
    try:
        model.fit(x, y)
    except tf_asgd.MetricStateError as e:
        print(e)  # "... metric 'running_max': the metric variable '...' ..."
    ```
    """


class TrainStepError(ValueError):
    """A model's own `train_step` that cannot run inside a window.

    Raised by `fit`, before any window is scheduled, for a model whose class
    overrides `train_step` in a way a window cannot run exactly: compiled with
    `run_eagerly=True` or with GEM, no compiled optimizer, variables created on
    the first call, a `train_step` that fails to trace, calls Python
    (`tf.py_function`), or assigns variables the model does not hold. A
    `ValueError`; its message names the model, what was found and how to write
    the step instead.

    Example:

    ```python
    try:
        model.fit(x, y)
    except tf_asgd.TrainStepError as e:
        print(e)  # "tf_asgd cannot run the `train_step` of MyModel (...) inside a window: ..."
    ```
    """


# ---- the cluster ------------------------------------------------------------


class ClusterUnreachableError(ConnectionError):
    """Some cluster tasks did not answer within the strategy's `connect_timeout`.

    Raised by `AsyncParameterServerStrategy(...)` before TF connects (nothing is
    connected then); a `ConnectionError`. Its message names each task, its address
    and why, and says what to check.

    Args:
        tasks: `[(job, index, address, reason), ...]`, the tasks that did not
            answer and why.
        timeout: the seconds waited.

    Attributes:
        tasks: `[(job, index, address, reason), ...]`, the tasks that did not
            answer and why (the last probe's error).
        timeout: the seconds waited.

    Example:

    ```python
    try:
        strategy = tf_asgd.AsyncParameterServerStrategy(resolver, connect_timeout=30)
    except tf_asgd.ClusterUnreachableError as e:
        for job, index, address, reason in e.tasks:
            print(f"{job}:{index} at {address}: {reason}")
    ```
    """

    def __init__(self, tasks, timeout):
        self.tasks, self.timeout = list(tasks), timeout
        super().__init__(self._message(_named(self.tasks)))

    def _message(self, named):
        """The error's text, given `named`, the tasks as `_named` writes them."""
        return (
            f"Could not reach {len(self.tasks)} cluster task(s) within {self.timeout:g} s: "
            f"{named}. Check that these tasks are running and that the cluster (TF_CONFIG, or "
            "the resolver's cluster spec) names their hosts and ports; connect_timeout sets "
            "how long to wait."
        )


class WorkersLostError(ClusterUnreachableError):
    """No worker could run closures, and the lost tasks did not come back in time.

    Raised by `fit` (or evaluation on the workers) once no worker could run
    closures and the tasks TF waits for to reconnect did not all answer within
    the strategy's `connect_timeout` (see `lost_workers`). A
    `ClusterUnreachableError`. The pushes that finished stay on the parameter
    servers; once every task answers again, the same strategy trains again.
    Its arguments and attributes, `tasks` and `timeout`, are
    `ClusterUnreachableError`'s; only the message differs.

    Example:

    ```python
    try:
        model.fit(x, y, epochs=3)
    except tf_asgd.WorkersLostError as e:
        print(e.tasks)  # start these again at the same addresses, then fit again
    ```
    """

    def _message(self, named):
        return (
            f"Lost the workers: none could run for {self.timeout:g} s, and {len(self.tasks)} "
            f"cluster task(s) did not answer: {named}. TensorFlow's coordinator runs "
            "closures again only once every task answers. The windows (or evaluation "
            "shards) not yet run were dropped; the pushes that finished are on the "
            "parameter servers. Start these tasks again at the same addresses: this "
            "strategy trains again once every task answers (until then each fit or "
            "evaluate raises this after at most connect_timeout); or restart the job "
            "from a checkpoint."
        )


class WorkerStalledError(WorkersLostError):
    """A worker neither finished nor failed its closure within `connect_timeout`.

    TensorFlow sees a worker as lost only when its connection fails. A worker whose
    process is stopped (SIGSTOP), hung on its device or cut off without its connection
    closing keeps its closure forever, and `fit` would wait for it without a bound. Raised
    by `fit` once the chief must wait for windows and no closure has finished for the
    strategy's `connect_timeout` (plus the closure's own time budget). A
    `WorkersLostError`: its `tasks` are the workers that finished no closure meanwhile,
    and `timeout` the seconds waited. The pushes that finished are on the parameter
    servers.

    Example:

    ```python
    try:
        model.fit(x, y, epochs=3)
    except tf_asgd.WorkerStalledError as e:
        print(e.tasks)  # restart these workers at the same addresses, then fit again
    ```
    """

    def __init__(self, tasks, timeout, during="fit"):
        self.during = during  # "fit", or "evaluate" (its shards write nothing)
        super().__init__(tasks, timeout)

    def _message(self, named):
        closures, kept = "window closure", "The pushes that finished are on the PS tasks."
        if self.during != "fit":
            closures, kept = "evaluation shard", "Its shards write nothing to the PS tasks."
        return (
            f"No {closures} finished for {self.timeout:g} s, and {len(self.tasks)} "
            f"worker(s) finished none meanwhile: {named}. TensorFlow takes a worker for "
            "lost only when its connection fails; one that is stopped, hung on its device "
            "or cut off without the connection closing holds its closure without a bound, "
            f"so {self.during} stopped here. {kept} "
            f"Restart these workers at the same addresses and {self.during} again (or "
            "restart the job from a checkpoint); connect_timeout sets how long to wait."
        )


class ClusterTaskLostError(RuntimeError):
    """Training stopped because a cluster task could not be reached.

    Raised by `fit` and `evaluate` when a parameter server is lost (killed, or
    restarted and so without its variables), from TF's error; and by the
    launcher (`python -m tf_asgd.launch`) when the chief loses contact with a
    parameter server, or with every worker, during training. A `RuntimeError`;
    its message names the lost tasks (or says that the link failed) and how to
    go on (the launcher: the checkpoint to `--resume` from).
    """


# ---- data -------------------------------------------------------------------


class MissingDataError(FileNotFoundError):
    """A data set is not where the config says it is (and was not downloaded).

    Its message names the path tried and how to get the data.
    """
