"""`AsyncParameterServerStrategy`: GPU A-SGD on TF's parameter-server runtime.

Example:
    import keras, tf_asgd

    with tf_asgd.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
        with strategy.scope():
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, epochs=2, batch_size=32)
        print(strategy.stats())
"""

import functools
import weakref

import tensorflow as tf

from tf_asgd import internals
from tf_asgd.cluster import connect, lost_workers, tf_config, tf_startup
from tf_asgd.cluster import local_cluster as cluster_lib
from tf_asgd.keras_glue import keras_hook
from tf_asgd.keras_glue.evaluation import validate_evaluation
from tf_asgd.keras_glue.model_state import ModelStates, TrainingData
from tf_asgd.rules import outer_optimizers, worker_rate
from tf_asgd.rules.compression import as_compression, as_pull_compression
from tf_asgd.rules.staleness import validate_staleness
from tf_asgd.runtime import input_sharding, optimizer_options, ps_recovery, python_inputs, rounds
from tf_asgd.runtime.async_scheduler import AsyncScheduler
from tf_asgd.runtime.counters import PushCounters
from tf_asgd.runtime.round_scheduler import RoundScheduler
from tf_asgd.runtime.scheduling import validate_windows_per_closure

# The strategies of this process whose coordinator runs. TF's eager context holds one
# cluster connection per process, so a new strategy's connection ends the earlier ones';
# their coordinators are stopped first, or a failure handler of theirs could reconnect
# the process to an old cluster under the new strategy.
_connected = weakref.WeakSet()


def _stop_earlier_strategies():
    for earlier in list(_connected):
        _connected.discard(earlier)
        internals.stop_coordinator(earlier.coordinator)


def _on_cluster_close(strategy_ref):
    """Run by a closing `LocalCluster` before its tasks stop: the strategy's coordinator is
    stopped, and its models refuse at once rather than wait for tasks that are gone."""
    strategy = strategy_ref()
    if strategy is not None:
        _connected.discard(strategy)
        strategy._cluster_closed = True  # (private: the strategy's own flag)
        internals.stop_coordinator(strategy.coordinator)


def _shard_ops():
    """How many `ShardDataset` ops the graph being traced holds."""
    ops = tf.compat.v1.get_default_graph().get_operations()
    return sum(op.type == "ShardDataset" for op in ops)


class _WindowDataset:
    """What `experimental_distribute_dataset` hands to Keras.

    Iterated during training, it yields one per-worker iterator of the
    dataset repeated forever, the same one every epoch (each worker draws its
    own batches; Keras's `steps_per_epoch` ends an epoch) and in a later
    `fit` on the same dataset object with the same `per_worker_dataset_fn`:
    each worker's stream continues there as it does from one epoch to the
    next (`model_state.TrainingData.iterator`). Iterated by
    evaluate, predict or the model's symbolic build
    (`keras_hook.local_mode`), it yields a plain iterator on the chief. For
    Python-side training data (a PyDataset, a generator, a pipeline that
    calls Python) it yields the `python_inputs.ChiefFeed` that reads it on the
    chief and sends the batches with each closure.

    The training data is split over the workers as TF's
    `MultiWorkerMirroredStrategy` splits it (`input_sharding`): arrays by batch;
    a `tf.data.Dataset` by its `auto_shard_policy`, by default by file where the
    pipeline reads at least as many files as there are workers, else by batch,
    so that the workers together see each example once per pass. Under
    `AutoShardPolicy.OFF` every worker reads all of it, and worker `i` skips
    `i` batches before its first window (`window.WindowFunction._shift_data_once`).
    `per_worker_dataset_fn` runs on the worker's shard.
    """

    def __init__(self, dataset, strategy):
        self._dataset = dataset
        self._strategy = strategy
        self._iterator = None

    def __iter__(self):
        feed = python_inputs.feed_of(self._dataset)  # Python-side data, read by the chief
        if keras_hook.in_local_mode():
            return iter(self._dataset) if feed is None else feed.local_iterator()
        if feed is not None:
            return feed
        if self._iterator is None:
            self._iterator = self._strategy.training_data.iterator(
                self._dataset, self._strategy.per_worker_dataset_fn, self._new_iterator
            )
        return self._iterator

    def _new_iterator(self):
        plan = self._strategy.training_data.shard_plan(self._dataset, self._strategy.num_workers)
        transform = self._strategy.per_worker_dataset_fn
        if plan.policy == input_sharding.Policy.OFF and transform is None:
            source = self._dataset.repeat()
        else:
            source = self._per_worker_fn(transform, plan)
        iterator = iter(self._strategy.coordinator.create_per_worker_dataset(source))
        if plan.policy != input_sharding.Policy.OFF:
            self._strategy.training_data.mark_sharded(iterator)
        return iterator

    def _per_worker_fn(self, transform, plan):
        """A dataset function that, on each worker, rebuilds the dataset from its
        serialized graph (as TF's coordinator sends a dataset object; a function that
        captured the dataset itself would fail on the worker), takes the worker's shard
        of it (`plan`, an `input_sharding.ShardPlan`) and applies
        `transform(dataset, worker_index)` (None: none)."""
        graph = plan.graph
        spec = self._dataset.element_spec

        def dataset_fn():
            dataset = input_sharding.rebuild(graph, spec)
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            dataset = input_sharding.shard(dataset, plan, index)
            if transform is None:
                return dataset.repeat()
            before = _shard_ops()
            out = transform(dataset, index)
            if not isinstance(out, tf.data.Dataset):
                raise TypeError(
                    "per_worker_dataset_fn must return a tf.data.Dataset, "
                    f"got {type(out).__name__}."
                )
            if out.element_spec != spec:
                raise ValueError(
                    "per_worker_dataset_fn must keep the dataset's element_spec "
                    f"(the model was built for it): got {out.element_spec}, expected {spec}."
                )
            if _shard_ops() > before and plan.policy != input_sharding.Policy.OFF:
                raise ValueError(
                    "per_worker_dataset_fn shards the dataset, which fit already shards "
                    "over the workers (each worker would keep 1/N of its 1/N). Either drop "
                    "the shard from per_worker_dataset_fn, or turn the automatic sharding "
                    "off: options = tf.data.Options(); options.experimental_distribute."
                    "auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF; "
                    "dataset = dataset.with_options(options)."
                )
            return out.repeat()

        return dataset_fn

    @property
    def element_spec(self):
        return self._dataset.element_spec


def _validate_inputs(n_sync, per_worker_dataset_fn, lr_scaling, epoch_barrier, synchronous):
    if isinstance(n_sync, bool) or not isinstance(n_sync, int) or n_sync <= 0:
        raise ValueError(f"n_sync must be a positive integer, got {n_sync!r}.")
    if not isinstance(epoch_barrier, bool):
        raise ValueError(f"epoch_barrier must be True or False, got {epoch_barrier!r}.")
    if synchronous and not epoch_barrier:
        raise ValueError(
            "epoch_barrier=False needs asynchronous windows: synchronous rounds end with "
            "each epoch. Leave epoch_barrier=True with synchronous=True."
        )
    if per_worker_dataset_fn is not None and not callable(per_worker_dataset_fn):
        raise TypeError(
            "per_worker_dataset_fn must be a function (dataset, worker_index) -> "
            f"dataset or None, got {per_worker_dataset_fn!r}."
        )
    worker_rate.validate_worker_rate(lr_scaling)


class AsyncParameterServerStrategy(tf.distribute.experimental.ParameterServerStrategy):
    """Asynchronous windowed SGD with staleness-scaled updates on the PS.

    Variables created under `scope()` live on the PS tasks (whole variables
    placed round-robin over the PS, or split by `variable_partitioner`).
    Keras's `model.fit` on a model built under the scope trains it with one
    `ClusterCoordinator` closure per window of `n_sync` local steps on some
    worker: pull, `n_sync` steps of the compiled optimizer on the worker's own
    copy, push the accumulated update once. The PS applies its outer
    optimizer to the pseudo-gradient `-staleness_scale(tau) * update`, where
    `tau` counts the pushes committed between this window's pull and its push.

    Defaults: each push counts the average `1/N`
    (`outer_optimizers.default_outer_optimizer(N)`, no staleness scaling), and the
    workers' local steps run at a multiple of the compiled optimizer's rate
    (`lr_scaling`: N falling toward 1 with Adam and its kin, `sqrt(N)` with
    SGD), so that N averaged windows move about as far as a batch N times
    larger. See docs/defaults.md.
    With a GEM optimizer the default is the paper's: every push added as is.
    With `synchronous=True` windows run in rounds instead: N windows from
    the same central weights, one outer step on their pushes (see Args).

    The strategy keeps each model's state (its `WindowTrainer` and
    `Evaluator`, whether `fit` is running: `model_states`) by model, weakly:
    nothing is set on the model.
    TensorFlow holds one cluster connection per process: a later strategy's
    ends this one's (its coordinator stops; `fit`, `evaluate` and `predict`
    then raise `RuntimeError`).

    Args:
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`
            (e.g. `TFConfigClusterResolver()` or `LocalCluster.resolver`) with
            at least one `ps` and one `worker` task.
        n_sync: local steps per window, a positive integer (`1` is classic
            per-step async SGD; choosing it: docs/guide/choosing.md).
        staleness: `"none"` (the default: no scaling) or `"dynsgd"` (scale by
            1/(tau+1)).
        max_staleness: pushes with `tau > max_staleness` are dropped and
            counted; `None` keeps every push.
        variable_partitioner: passed to `ParameterServerStrategy`; `None`
            places whole variables round-robin over the PS tasks.
        per_worker_dataset_fn: optional `fn(dataset, worker_index) -> dataset`,
            run on each worker (inside a `tf.function`; `worker_index` is a
            scalar tensor) on the worker's shard of the batched data that `fit`
            was given, before it is repeated: e.g. emulate workers of different
            speeds (`tf_asgd.data.emulated_device_time`). It must keep the
            dataset's `element_spec`. Training data is sharded over the workers
            as `tf.distribute` does: arrays by batch, a `tf.data.Dataset` by its
            `options().experimental_distribute.auto_shard_policy` (`AUTO`: by file
            where it reads enough files, else by batch). A function that shards
            again is refused; to shard by hand, set the policy to `OFF` (the
            function then gets all of the data). See docs/guide/data.md.
        outer_optimizer: what the PS does with each push:
            `tf_asgd.OuterSGD(learning_rate, momentum, nesterov)` (DiLoCo's is
            `OuterSGD(0.7, momentum=0.9, nesterov=True)`) or
            `tf_asgd.DelayedNesterov(learning_rate, momentum, delay)`. `None`:
            `outer_optimizers.default_outer_optimizer(num_workers, ...)` (the
            rate `outer_optimizers.default_outer_learning_rate(num_workers)`, on
            3 and 4 workers at the user's rate or `sqrt(N)` times it after a
            schedule over the first pushes that starts from the average
            `1 / num_workers`), or `OuterSGD()` (add as is) for GEM.
            Its state lives on the PS beside each variable (or shard).
        worker_state: what a worker does with its own optimizer state
            (momentum, Adam's moments) at each pull: `"keep"` it across
            windows (the default), or `"reset"` it to its initial value.
        windows_per_closure: windows a worker runs back to back per
            `ClusterCoordinator` closure (each with its own pull, ticket and
            push): `None` sizes closures automatically to about 200 ms of
            work; an integer from 1 to 256 fixes it. Closures shrink near an
            epoch's end, and a slow worker's closure hands back the windows
            it did not start (see `scheduling`).
        evaluation: where `model.evaluate` and `fit`'s validation run:
            `"workers"` (the default: sharded over the workers, exact: each
            example once, metric states added on the chief; see `evaluation`)
            or `"chief"` (Keras's own loop on the chief). What the workers
            cannot do exactly (a model's own `test_step`, a metric whose state
            does not merge by addition, Python-side inputs) runs on the chief,
            with a log line.
        connect_timeout: seconds to wait for every ps and worker task to answer
            before connecting (tasks may start later); past it, a
            `tf_asgd.ClusterUnreachableError` names each silent task and address.
            Also how long `fit` and `evaluate` wait, once no worker can run
            (every worker lost), for the lost tasks to come back; past it, a
            `tf_asgd.WorkersLostError` names each (see `lost_workers`).
            600 s (10 minutes, torchrun's default) by default: pods and
            hand-started servers come up minutes apart. The wait logs the tasks
            it still waits for at once, then at least every 30 s.
        compression: how each push's update travels to the PS: `None` or
            `"none"` (float32 as it is, the default), `"bf16"`, `"int8"`
            (per-block absmax scales), `"topk"` (the largest 1%), or a
            `tf_asgd.Compression(...)` with its block or fraction. Lossy
            codecs keep an error-feedback residual per worker (what was not
            sent is added to the next push), committed with the push; each PS
            decodes its own pieces before the staleness scale and the outer
            optimizer. Only float32 variables are compressed; others travel
            as they are.
        pull_compression: how each window's pull travels to the worker:
            `None` or `"none"` (float32, the default) or `"bf16"`: the PS
            sends a bfloat16 copy of each float32 variable and keeps float32
            itself. The worker trains from that copy and pushes its weights
            minus the copy, so nothing of its steps is lost; the central
            variables (what `fit` leaves in the model) stay float32. No
            memory on the PS. GEM's rule then sees the bfloat16 copy.
        synchronous: `False` (the default): asynchronous windows, each
            pushed as it finishes. `True`: rounds. Each round's N windows
            (N = the number of workers) start from the same central weights
            and the PS applies the outer optimizer to their N pushes, all of
            staleness 0: their mean with `OuterSGD(1 / N)`, one Nesterov step
            on it with `DelayedNesterov` (DiLoCo). The default
            `outer_optimizer` is then
            `outer_optimizers.default_synchronous_outer_optimizer(num_workers)`
            (gain N). A lost worker's window runs again, exactly once; an
            epoch's last round splits the steps left over its windows; a
            NaN/Inf update stops `fit` with a `FloatingPointError`. Refused
            (`ValueError`): a staleness rule, `max_staleness`,
            `windows_per_closure` above 1, an `OuterSGD` with momentum or a
            schedule, a `DelayedNesterov` whose `delay` is not N, and, at
            `fit`, GEM and Python-side training data. How rounds work:
            docs/architecture.md; when to choose them:
            docs/guide/choosing.md.
        snapshot_every: the longest time between snapshots of the central
            state (every PS variable, read on the chief where no push is half
            applied), in seconds: 60 by default; `None` takes none. Within it a
            snapshot is taken as often as costs at most 1% of the time. A PS
            lost during `fit` and answering again on its address (restarted,
            or a pod back on its name) within `connect_timeout` is recovered
            in the run: the whole cluster goes back to the newest snapshot,
            the pushes since it are rolled back and train again (in
            synchronous mode, the rounds since it, whole and in order;
            `strategy.recoveries` counts them), and `fit` goes on. Without a
            snapshot, or past `connect_timeout`, `fit` stops with
            `tf_asgd.ClusterTaskLostError`.
            See docs/faults.md.
        lr_scaling: the workers' learning rate, for N workers. `"auto"` (the
            default): where the PS averages the pushes (the asynchronous
            default outer optimizer), each worker's local steps run at a
            multiple of the compiled optimizer's rate, so that a round of N
            averaged windows moves about as far as a batch N times larger
            would: with Adam and its kin (`optimizer_options.is_adaptive`) N
            times it, falling toward the rate itself as 1/t of each
            `fit`'s steps (`"anneal"`), or staying N where the rate is a
            `LearningRateSchedule` (`"linear"`: the schedule lowers it);
            with others `sqrt(N)` times it.
            With an `outer_optimizer` given, synchronous rounds or GEM, the
            rate is the user's. `"sqrt"`, `"anneal"`, `"linear"` (times N) or
            a number set the factor for any optimizer; `"none"` keeps the
            user's rate. The factor rises linearly from 1 over the first
            quarter of each `fit` where it anneals (at most
            `2 / (1 - beta_2)` steps for Adam's kin), over its first
            5% where it stays (Goyal et al.'s warm-up). The chief's
            optimizer, its callbacks and checkpoints keep the user's rate;
            `model_stats(model)` reports the factors (`lr_scale_peak`,
            `lr_scale`). Why: docs/defaults.md.
        epoch_barrier: `True` (the default): each epoch's end waits for its
            windows, so validation and callbacks see every window of the
            epoch applied (stock TF's `fit` does the same). `False`
            (asynchronous only): an epoch's end waits for none, and the
            workers go on with the next epoch's windows while Keras validates
            and calls the epoch's callbacks on the central model as it is
            then; the windows that finish after it count in the next epoch's
            metrics. The fit's last epoch, and an epoch after which training
            stops, still wait for every window. Where an epoch has few
            windows per worker this keeps the workers busy, but each push
            is staler: results/epoch_barrier.

    Raises:
        ValueError: `n_sync` not a positive integer; an unknown `staleness`,
            `lr_scaling`, `worker_state` or `evaluation`; `max_staleness` not an integer
            >= 0; `windows_per_closure` not `None` or an integer from 1 to 256;
            `connect_timeout` not a positive number; an address in the cluster
            spec that cannot be right (no host, a port outside 1-65535); an unknown `compression`
            codec (or a bad block or fraction); a `pull_compression` other
            than `"none"` and `"bf16"`; a cluster without a `ps` or a
            `worker` task; `synchronous` not a bool, or combined with an
            option it refuses (see `synchronous`); `epoch_barrier` not a bool,
            or `False` with `synchronous=True`. Each is checked before
            connecting.
        TypeError: `per_worker_dataset_fn` is not callable, `outer_optimizer`
            is not an `OuterSGD` or a `DelayedNesterov`, or `compression`
            (or `pull_compression`) is not `None`, a codec name or a
            `Compression`.
        tf_asgd.ClusterUnreachableError: some task did not answer within
            `connect_timeout`.

    Attributes:
        n_sync: as given.
        staleness: as given.
        max_staleness: as given.
        per_worker_dataset_fn: as given.
        outer_optimizer: as given.
        worker_state: as given.
        windows_per_closure: as given.
        evaluation: as given; may be set again later.
        compression: the `Compression` of pushes (`Compression("none")` for
            `None`).
        pull_compression: the `Compression` of pulls, likewise.
        connect_timeout: as given; may be set again later.
        synchronous: as given.
        snapshot_every: as given; may be set again later.
        lr_scaling: as given.
        recoveries: a `ps_recovery.Recovery` per PS recovered during `fit`.
        num_workers: the number of `worker` tasks in the cluster.
        coordinator: the strategy's `tf.distribute.coordinator.ClusterCoordinator`.
        counters: the `counters.PushCounters` on the PS.
        model_states: the `model_state.ModelStates` of the models under this
            strategy (for the Keras hook, the tools and the tests).
        training_data: the `model_state.TrainingData` of the datasets `fit`
            trained on (for the Keras hook).

    Example:

    ```python
    import keras, tf_asgd

    (x, y), (x_test, y_test) = tf_asgd.data.load_digits()
    with tf_asgd.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = tf_asgd.AsyncParameterServerStrategy(cluster.resolver, n_sync=10)
        with strategy.scope():
            model = tf_asgd.models.digits_convnet()
            model.compile(
                keras.optimizers.SGD(0.05, momentum=0.9),
                keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        model.fit(x, y, batch_size=32, epochs=3)
        print(model.evaluate(x_test, y_test), strategy.model_stats(model))
    ```
    """

    # How `keras_hook` (and `gem.pi_history`) recognise this strategy without
    # importing this module; TF's coordinator does the same with
    # `_is_parameter_server_strategy_v2`.
    _is_tf_asgd_strategy = True

    def __init__(
        self,
        cluster_resolver,
        n_sync=10,
        staleness="none",
        max_staleness=None,
        variable_partitioner=None,
        per_worker_dataset_fn=None,
        outer_optimizer=None,
        worker_state="keep",
        windows_per_closure=None,
        evaluation="workers",
        connect_timeout=connect.DEFAULT_CONNECT_TIMEOUT,
        compression=None,
        pull_compression=None,
        synchronous=False,
        snapshot_every=ps_recovery.DEFAULT_SNAPSHOT_EVERY,
        lr_scaling="auto",
        epoch_barrier=True,
    ):
        # Validate everything before connecting, so bad input changes nothing.
        _validate_inputs(n_sync, per_worker_dataset_fn, lr_scaling, epoch_barrier, synchronous)
        validate_staleness(staleness, max_staleness)
        if outer_optimizer is not None:
            outer_optimizers.validate_outer_optimizer(outer_optimizer)
        outer_optimizers.validate_worker_state(worker_state)
        validate_windows_per_closure(windows_per_closure)
        validate_evaluation(evaluation)
        compression = as_compression(compression)
        pull_compression = as_pull_compression(pull_compression)
        tf_config.validate_coordinator_task(cluster_resolver)
        cluster_resolver = tf_config.without_evaluator(cluster_resolver)
        spec = cluster_resolver.cluster_spec()
        tf_config.validate_cluster_spec(spec.as_dict())
        workers = spec.num_tasks("worker")
        options = (staleness, max_staleness, windows_per_closure, outer_optimizer, workers)
        rounds.validate_synchronous(synchronous, *options)
        ps_recovery.validate_snapshot_every(snapshot_every)
        connect.wait_for_cluster(cluster_resolver, connect_timeout)  # TF's own wait has no bound
        keras_hook.install()
        _stop_earlier_strategies()
        # Connecting starts this process's gRPC server and TF's devices: their start-up
        # lines (the address, a failed cuInit) are dropped, anything else is shown.
        with (
            tf_startup.quiet_tf_startup(not tf_startup.verbose_tf()),
            tf_startup.one_tf_log_handler(),
        ):
            self._connect(cluster_resolver, variable_partitioner)
        self.n_sync = n_sync
        self.staleness = staleness
        self.max_staleness = max_staleness
        self.per_worker_dataset_fn = per_worker_dataset_fn
        self.outer_optimizer = outer_optimizer
        self.worker_state = worker_state
        self.windows_per_closure = windows_per_closure
        self.evaluation = evaluation
        self.connect_timeout = connect_timeout
        self.compression, self.pull_compression = compression, pull_compression
        self.synchronous, self.lr_scaling = synchronous, lr_scaling
        self.epoch_barrier = epoch_barrier
        # (TF's `cluster_resolver` is None here.) A lost task is named from the dict.
        self.num_workers, self.cluster_spec = workers, spec.as_dict()
        # evaluate/predict run on the chief against the central variables.
        internals.allow_run_without_coordinator(self)
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self)
        _connected.add(self)
        # TF waits for a lost worker without a bound; this bounds it by connect_timeout.
        self._reconnection_watch = lost_workers.ReconnectionWatch(
            self, self.coordinator, self.cluster_spec
        )
        self._cluster_closed = False
        cluster_lib.before_stop(
            self.cluster_spec, functools.partial(_on_cluster_close, weakref.ref(self))
        )
        # Registers every variable the scope creates from now on, the counters first.
        self.ps_recovery = ps_recovery.PSRecovery(self, snapshot_every)
        with self.scope():
            self.counters = PushCounters()
        self.model_states = ModelStates(self, self._outer_optimizer_for)
        self.training_data = TrainingData()

    def _connect(self, cluster_resolver, variable_partitioner):
        """TF's own connection (`ParameterServerStrategy.__init__`), with the chief's port
        in use named in one line (TF's `UnknownError` names neither task nor port)."""
        try:
            super().__init__(cluster_resolver, variable_partitioner=variable_partitioner)
        except tf.errors.UnknownError as e:
            if "Could not start gRPC server" not in str(e):
                raise
            address = cluster_resolver.cluster_spec().as_dict().get("chief", ["?"])[0]
            raise RuntimeError(
                f"Could not start this process's TF server, the chief's, at {address}: is "
                "its port in use by another process (an earlier run still alive)? Stop "
                "that process, or give the chief another port in the cluster spec."
            ) from None

    @property
    def connect_timeout(self):
        """Seconds to wait for unanswering cluster tasks (see the class's Args).

        May be set again; a value that is not a positive finite number of
        seconds raises `ValueError` (and leaves it unchanged).
        """
        return self._connect_timeout

    @connect_timeout.setter
    def connect_timeout(self, value):
        connect.validate_connect_timeout(value)
        self._connect_timeout = value

    @property
    def snapshot_every(self):
        """The longest time between snapshots of the central state, in seconds (None:
        none; see the class's Args). May be set again; a value that is not None or a
        positive number raises `ValueError` (and leaves it unchanged)."""
        return self.ps_recovery.snapshot_every

    @snapshot_every.setter
    def snapshot_every(self, value):
        ps_recovery.validate_snapshot_every(value)
        self.ps_recovery.snapshot_every = value

    @property
    def scheduler_type(self):
        """The `scheduler.WindowScheduler` class a model's trainer groups its windows with:
        `RoundScheduler` with `synchronous=True`, else `AsyncScheduler`."""
        return RoundScheduler if self.synchronous else AsyncScheduler

    @property
    def recoveries(self):
        """A `ps_recovery.Recovery` per parameter server recovered during `fit`."""
        return list(self.ps_recovery.recoveries)

    @property
    def evaluation(self):
        """Where `evaluate` and `fit`'s validation run: "workers" or "chief".

        May be set again (the next `evaluate` follows it); any other value
        raises `ValueError` (and leaves it unchanged).
        """
        return self._evaluation

    @evaluation.setter
    def evaluation(self, value):
        validate_evaluation(value)
        self._evaluation = value

    def experimental_distribute_dataset(self, dataset, options=None):
        """What Keras's `fit`, `evaluate` and `predict` iterate over.

        Args:
            dataset: a `tf.data.Dataset` (Keras's adapted training or
                evaluation data).
            options: ignored (kept for the `tf.distribute.Strategy` signature).

        Returns:
            An iterable that gives per-worker iterators during training and
            plain local ones on the chief (evaluate, predict, build).
        """
        return _WindowDataset(dataset, self)

    def stats(self, model=None):
        """The run's push counters (a few reads from the PS).

        The counters are the strategy's (every push under it); the bytes
        pulled and pushed are counted at `model`'s size per window, and per
        sample over the mean samples of `model`'s windows so far.

        Args:
            model: a Keras model trained under this strategy, which gives the
                byte counts their size; None (or a model not trained under
                this strategy) reports them as 0.

        Returns:
            An `AsyncStats`.
        """
        trainer = self._trainer(model)
        if trainer is None:
            return self.counters.stats(0, 0)
        return trainer.stats()

    def window_log(self, model):
        """Every finished window of `model`'s training so far.

        Args:
            model: a Keras model trained under this strategy.

        Returns:
            A list of `WindowRecord` (worker, pushed, staleness, mean loss,
            times, metric state, GEM's pi statistics), in the order the chief
            saw the windows finish, over every `fit` of `model` so far; empty
            if `model` has not been trained.

        Example:

        ```python
        log = strategy.window_log(model)
        print(len(log), sum(r.staleness for r in log if r.pushed) / len(log))
        ```
        """
        trainer = self._trainer(model)
        return list(trainer.window_log) if trainer else []

    def window_results(self, model, record):
        """Metric results of one window's own steps.

        Args:
            model: the Keras model whose `window_log` holds `record`.
            record: a `WindowRecord` of `window_log(model)`.

        Returns:
            A dict of metric results, e.g. `{"loss": 0.31, "accuracy": 0.9}`.

        Raises:
            ValueError: `model` has not been trained under this strategy.
        """
        trainer = self._trainer(model)
        if trainer is None:
            raise ValueError(f"Model {model.name!r} has not been trained under this strategy.")
        return trainer.log.window_results(record)

    def model_stats(self, model):
        """`stats(model)`: the push counters, with byte counts for `model`.

        The counters are the strategy's (every push under it); the bytes pulled
        and pushed are counted at `model`'s size per window, and per sample
        over the mean samples of `model`'s windows so far.

        Args:
            model: a Keras model trained under this strategy (if not, the
                byte counts are 0).

        Returns:
            An `AsyncStats`.

        Example:

        ```python
        model.fit(x, y, epochs=3)
        stats = strategy.model_stats(model)
        print(stats.windows, stats.mean_staleness, stats.bytes_pushed / 1e6, "MB")
        ```
        """
        return self.stats(model)

    def outer_state(self, model):
        """The PS's outer-optimizer state of `model`, to checkpoint.

        A `tf.Module` whose variables are the outer optimizer's slots (e.g.
        the outer momentum beside each PS variable). They are created by the
        model's first `fit`; a checkpoint restored before then restores them
        when they are created (TF's deferred restoration).

        Args:
            model: a Keras model created under this strategy's scope.

        Returns:
            A `tf.Module`, the same one on every call for `model`.

        Example:

        ```python
        ckpt = tf.train.Checkpoint(model=model, optimizer=model.optimizer,
                                   outer=strategy.outer_state(model))
        ckpt.restore(path)  # before fit: the outer slots follow on creation
        model.fit(...)
        ```
        """
        state = self.model_states.get_or_create(model)
        if state.outer_state is None:
            state.outer_state = tf.Module(name="outer_state")
        return state.outer_state

    def check_connected(self):
        """Raises `RuntimeError` once a later strategy of this process has
        connected (TensorFlow holds one cluster connection per process)."""
        if self._cluster_closed:
            raise RuntimeError(
                "This AsyncParameterServerStrategy's LocalCluster was closed: its tasks are "
                "gone. Use the model inside the `with LocalCluster(...)` block, or save it "
                "there (`model.save`) and load it as a plain Keras model."
            )
        if self not in _connected:
            raise RuntimeError(
                "This AsyncParameterServerStrategy no longer has a cluster connection: a "
                "later strategy was created in this process, and TensorFlow holds one "
                "connection per process. Build and compile the model under the newest "
                "strategy's scope."
            )

    def _trainer(self, model):
        """`model`'s `WindowTrainer`, or None if it has none (or `model` is None)."""
        state = None if model is None else self.model_states.get(model)
        return None if state is None else state.trainer

    def worker_rate_scale(self, optimizer):
        """The factor on the workers' learning rate for a model compiled with
        `optimizer` (see `lr_scaling`), once warmed up and annealed: 1.0 where
        nothing is scaled.

        Raises:
            ValueError: `lr_scaling` names a rule or a factor for GEM.
        """
        return worker_rate.worker_rate_scale(self.num_workers, self._worker_rate(optimizer))

    def worker_rate_peak(self, optimizer):
        """The factor on the workers' learning rate at the end of the warm-up (N under
        `"anneal"`, which then falls to `worker_rate_scale`; that factor otherwise)."""
        return worker_rate.worker_rate_peak(self.num_workers, self._worker_rate(optimizer))

    def _worker_rate(self, optimizer):
        """The `lr_scaling` rule for `optimizer`: `"auto"` resolved, `"none"` for GEM."""
        if getattr(optimizer, "asgd_push_rule", None) is not None:
            if self.lr_scaling not in ("auto", "none"):
                raise ValueError(
                    f"lr_scaling={self.lr_scaling!r} cannot be used with GEM, whose local "
                    "steps are the paper's: pass lr_scaling='auto' or 'none'."
                )
            return "none"
        if self.lr_scaling != "auto":
            return self.lr_scaling
        return optimizer_options.auto_worker_rate(
            optimizer, self.synchronous, outer_given=self.outer_optimizer is not None
        )

    def _outer_optimizer_for(self, optimizer):
        """The outer optimizer the pushes of a model compiled with `optimizer` get (see
        `outer_optimizer`); refuses GEM in synchronous mode."""
        push_rule = getattr(optimizer, "asgd_push_rule", None)
        self.scheduler_type.check_push_rule(push_rule)
        if self.outer_optimizer is not None:
            return self.outer_optimizer
        if push_rule is not None:
            return outer_optimizers.OuterSGD()  # GEM: the paper's PS adds pushes as is
        return self.scheduler_type.default_outer_optimizer(
            self.num_workers, self.worker_rate_peak(optimizer)
        )
